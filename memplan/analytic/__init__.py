"""The blocks (``memplan.blocks``) composed into a layer and a model: the inventory's vocabulary, parameters,
the activation inventory, FLOPs and the peak's moments.

Nothing here imports torch; every function returns int bytes or int FLOPs.
"""
