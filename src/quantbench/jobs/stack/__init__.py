"""`quantbench stack NAME`: the speedup ledger. Each technique's multiplier and its quality cost,
stacked and measured in one run.

- schema: the stack file (stacks/NAME.yaml), its checks, and each step's configuration
- models: each step's model found (its recipe run first when it has none), its quality against the base
- measure: every step measured in every round, on the same prompts
- ledger: the multipliers with their intervals, the policy's quality checks, the table and the plot
- best: --best, the fastest subset of the steps whose model passes the policy
- command: `run`, from the stack file to the MLflow runs
"""
