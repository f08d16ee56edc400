"""Online RL with verifiable rewards: GRPO and its family (TRL 1.16's GRPOTrainer), rollouts drawn
on the training mesh, prompts and reward functions as TRL reads and calls them."""
