"""Deciding what ships: compare (the table and the Pareto frontier), gate (policies, the registry),
the model card, metric names a policy may use. Reads runs; runs no stage."""
