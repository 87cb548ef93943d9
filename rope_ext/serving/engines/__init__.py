"""What each serving engine computes from a model's config, read from its sources."""
