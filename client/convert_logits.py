"""Logits policies (what a caller asks a step to return) and logits outputs (what it returns).

Both directions of one concept, shared by the request builders (convert_requests) and the
response readers (convert_responses); client.convert re-exports them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._proto import executor_pb2 as pb
from .convert_tensors import data_type, tensor_to_ndarray
from .types import LogitsAdjustments, LogitsOutput, LogitsPolicy

_KIND_NAMES: dict[int, str] = {
    pb.LOGITS_KIND_FULL: "full",
    pb.LOGITS_KIND_ARGMAX: "argmax",
    pb.LOGITS_KIND_TOP_K: "top_k",
    pb.LOGITS_KIND_SAMPLE: "sample",
}
_LOGITS_DTYPE_NAMES: dict[int, str] = {
    pb.DATA_TYPE_FLOAT32: "float32",
    pb.DATA_TYPE_BFLOAT16: "bfloat16",
    pb.DATA_TYPE_FLOAT16: "float16",
}


def policy_to_proto(policy: LogitsPolicy) -> pb.LogitsPolicy:
    """The wire form of a policy (callers leave the field unset for None)."""
    if policy.kind == "full":
        out = pb.LogitsPolicy(full=pb.FullLogits(dtype=data_type(policy.dtype)))
    elif policy.kind == "argmax":
        out = pb.LogitsPolicy(argmax=pb.ArgmaxToken(top_logprobs=policy.top_logprobs))
    elif policy.kind == "top_k":
        out = pb.LogitsPolicy(top_k=pb.TopKLogprobs(k=policy.k))
    elif policy.kind == "sample":
        sample = pb.SampleToken(temperature=policy.temperature, top_k=policy.k, top_logprobs=policy.top_logprobs)
        if policy.top_p is not None:
            sample.top_p = policy.top_p
        if policy.seed is not None:
            sample.seed = policy.seed
        if policy.min_p is not None:
            sample.min_p = policy.min_p
        out = pb.LogitsPolicy(sample=sample)
    else:
        raise ValueError(f"unknown logits policy kind {policy.kind!r}")
    if policy.adjustments is not None:
        out.adjustments.CopyFrom(adjustments_to_proto(policy.adjustments))
    return out


def adjustments_to_proto(adjustments: LogitsAdjustments) -> pb.LogitsAdjustments:
    out = pb.LogitsAdjustments(
        penalized_token_ids=adjustments.penalized_token_ids,
        penalized_token_counts=adjustments.penalized_token_counts,
        presence_penalty=adjustments.presence_penalty,
        frequency_penalty=adjustments.frequency_penalty,
        logit_bias=dict(adjustments.logit_bias),
        allowed_token_ids=adjustments.allowed_token_ids,
        banned_token_ids=adjustments.banned_token_ids,
    )
    if adjustments.repetition_penalty is not None:
        out.repetition_penalty = adjustments.repetition_penalty
    return out


def adjustments_from_proto(msg: pb.LogitsAdjustments) -> LogitsAdjustments:
    return LogitsAdjustments(
        penalized_token_ids=tuple(msg.penalized_token_ids),
        penalized_token_counts=tuple(msg.penalized_token_counts),
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        allowed_token_ids=tuple(msg.allowed_token_ids),
        banned_token_ids=tuple(msg.banned_token_ids),
    )


def policy_from_proto(policy: pb.LogitsPolicy) -> LogitsPolicy | None:
    """The domain form of a policy; None when unset (full float32)."""
    which = policy.WhichOneof("policy")
    adjustments = adjustments_from_proto(policy.adjustments) if policy.HasField("adjustments") else None
    if which is None:
        return None
    if which == "full":
        return LogitsPolicy.full(_LOGITS_DTYPE_NAMES.get(policy.full.dtype, "float32"))  # type: ignore[arg-type]
    if which == "argmax":
        return LogitsPolicy.argmax(adjustments, top_logprobs=policy.argmax.top_logprobs)
    if which == "top_k":
        return LogitsPolicy.top_k(policy.top_k.k)
    s = policy.sample
    return LogitsPolicy.sample(
        s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else None,
        seed=s.seed if s.HasField("seed") else None,
        min_p=s.min_p if s.HasField("min_p") else None,
        adjustments=adjustments,
        top_logprobs=s.top_logprobs,
    )


def _set_policy(target: Any, policy: LogitsPolicy | None) -> None:
    """target.logits_policy from policy (left unset for None), in place."""
    if policy is None:
        return
    if policy.kind == "argmax" and policy.adjustments is None and not policy.top_logprobs:
        target.logits_policy.argmax.SetInParent()
    else:
        target.logits_policy.CopyFrom(policy_to_proto(policy))


def logits_from_proto(output: pb.LogitsOutput) -> LogitsOutput:
    """The domain form of one LogitsOutput; only the fields of its kind are set."""
    kind = _KIND_NAMES.get(output.kind, "unspecified")
    if kind == "argmax" and not output.top_token_ids:  # a decode step's usual answer: one constructor call
        return LogitsOutput(kind, token_id=output.token_id, logprob=output.logprob)
    result = LogitsOutput(kind=kind)
    if kind == "full":
        result.logits = tensor_to_ndarray(output.logits)
    if kind in ("argmax", "sample"):
        result.token_id = output.token_id
        result.logprob = output.logprob
    if kind == "sample":
        result.sampling_logprob = output.sampling_logprob
    if kind == "top_k" or output.top_token_ids:  # with argmax and sample: their top_logprobs
        result.top_token_ids = np.array(output.top_token_ids, dtype=np.int64)
        result.top_logprobs = np.array(output.top_logprobs, dtype=np.float32)
    return result
