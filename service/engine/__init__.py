"""The native PyTorch engine: scheduler, runner, sampler, drafters, the engine thread."""
