"""hivetrain.peer: the client: config, model, data, the DiLoCo loop, averaging, CLI."""
