"""A layer's backward moments beside ``analytic.peak``: the transient of a layer's backward
(``layer_backward``), what a layer keeps as its backward frees it (``layer_saves``), each layer kind's terms
(``layer_kinds``), and the terms of particular code: post norms, fused QKV input gradients, reentrant
checkpointing, sequence parallelism's and float8 tensor parallelism's moments, peft's MLP adapters."""
