"""KV checkpoints: the wire format, the holder service and the engine-side streamer."""
