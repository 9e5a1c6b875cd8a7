"""Experience making (rollouts -> scored, advantage-bearing samples) and the replay buffer."""
