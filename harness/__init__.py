"""k3verify harness: captures, replay, metrics, tolerance policy, reports, CLI."""
