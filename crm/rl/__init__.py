"""A CRM as the reward of reinforcement learning: crm-rl's harness (TRL's GRPO, a tiny policy,
controls and evidence), OpenRLHF's remote reward server and verl's compute_score (docs/RL.md)."""
