"""GRPO on the demo task, with specroll serving the rollouts (see README.md here)."""
