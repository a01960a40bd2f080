"""legorl: reinforcement learning for coding agents inside their own harnesses."""

__version__ = "0.1.0"
