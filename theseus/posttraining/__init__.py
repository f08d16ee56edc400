"""Post-training objectives, each the family's trainer with its own loss on the shared step: online
RL with verifiable rewards (GRPO and its family: :mod:`theseus.posttraining.rl`) and preference
tuning (DPO family, ORPO, SimPO: :mod:`theseus.posttraining.preference`)."""
