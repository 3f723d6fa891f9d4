"""A CRM as the reward of reinforcement learning: crm-rl's harness (TRL's GRPO, a tiny policy,
controls and evidence), OpenRLHF's remote reward server and verl's reward manager (docs/RL.md)."""
