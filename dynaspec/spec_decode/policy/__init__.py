"""The K decision and its prices: the K policies, acceptance histories and the step cost model."""
