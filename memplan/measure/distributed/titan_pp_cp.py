"""Context parallelism inside torchtitan's pipeline stages (``--impl torchtitan --pp P [--vpp M] --cp C``):
one rank of the (pp, dp, cp, tp) mesh torchtitan builds, its chunks' attention through torch's ring over
the rank's cp group, its micro-batches sharded as torchtitan's trainer shards them.

torchtitan's ``pp_forward_backward_step`` runs ``post_dataloading_process`` per micro-batch:
``prepare_context_parallel_input`` shards the ids, the labels and the positions along the sequence with
``_HeadTailLoadBalancer`` (chunks r and 2c−1−r: ``reference.context.head_tail_positions``), and the
schedule gets the positions as every stage's keyword argument (``kwarg_mbs``), so each block's RoPE gathers
the rank's rows of its own cache, as without pp (``frameworks.titan``'s module docstring). The stages pass
[b, s/c, h] hidden states; the last stage's logits are [b, s/c, v].

Known limitations:
- NB: the ring attention is ``frameworks.titan_attention.ring_attention`` (torch's ring functions with
  the CPU flash kernel over the mesh's cp group), as in the non-pipeline run.
"""

from __future__ import annotations

from typing import Any

import torch

from memplan.config import Setup
from memplan.measure.reference.context import head_tail_positions
from memplan.measure.runs.run import make_batch


def local_setup(setup: Setup) -> Setup:
    """``setup`` as one cp rank sees its sequence (s/c tokens): the stages' static shapes."""
    cp = setup.parallel.cp
    if cp == 1:
        return setup
    training = setup.training.model_copy(update={"seq_len": setup.training.seq_len // cp})
    return setup.model_copy(update={"training": training})


def cp_batches(setup: Setup, n: int, cp_rank: int) -> tuple[list[tuple[Any, Any]], list[dict[str, Any]]]:
    """``n`` micro-batches as cp rank ``cp_rank`` holds them (ids and labels sharded head-tail) and each
    micro-batch's keyword arguments for the stages: the rank's positions [b, s/c], a new storage each
    (``positions`` sharded as the inputs); without cp the whole batches and no keyword arguments."""
    batches = [make_batch(setup, "cpu") for _ in range(n)]
    cp, s = setup.parallel.cp, setup.training.seq_len
    if cp == 1:
        return batches, [{} for _ in batches]
    mine = head_tail_positions(s, cp, cp_rank)
    sharded = [(ids[:, mine], labels[:, mine]) for ids, labels in batches]
    b = setup.training.micro_batch
    kwargs = [{"positions": torch.arange(s).expand(b, -1)[:, mine]} for _ in batches]
    return sharded, kwargs
