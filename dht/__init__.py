"""hivetrain.dht: the one facade over hivemind's DHT, and the signed record schemas."""
