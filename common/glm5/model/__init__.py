"""The GlmMoeDsa model: config, layers, checkpoint loading."""
