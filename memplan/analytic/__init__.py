"""Pure functions of the configuration: parameters, model states, activations, FLOPs, peak.

Nothing here imports torch; every function returns int bytes or int FLOPs.
"""
