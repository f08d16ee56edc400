"""Post-training objectives: online RL with verifiable rewards (GRPO and its family)."""
