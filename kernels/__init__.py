"""hivetrain.kernels: pure tensor codecs (no network, no clock, no hivemind)."""
