"""Unit tests of client.convert: tensors, metadata, policies, handles, request/response mapping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from client import convert
from client.logits_policy import with_banned
from client.types import (
    DecodeInput,
    KvCacheHandle,
    LogitsAdjustments,
    LogitsOutput,
    LogitsPolicy,
    Penalties,
    PrefillInput,
    UnifiedBatch,
    UnifiedBatchItem,
)
from generated.modelexec.v1 import executor_pb2 as pb

_SAMPLES: dict[str, np.ndarray] = {
    "float32": np.array([[0.0, -1.5, 3.25], [1e-30, np.inf, -np.inf]], dtype=np.float32),
    "float16": np.array([[0.0, -1.5, 65504.0], [6e-8, np.inf, -2.0]], dtype=np.float16),
    "int32": np.array([[-(2**31), 0, 2**31 - 1]], dtype=np.int32),
    "int64": np.array([-(2**63), 0, 2**63 - 1], dtype=np.int64),
    "uint32": np.array([0, 1, 2**32 - 1], dtype=np.uint32),
    "int8": np.array([-128, 0, 127], dtype=np.int8),
    "uint8": np.array([0, 7, 255], dtype=np.uint8),
    "bool": np.array([[True, False], [False, True]]),
    # Every value here is exactly representable in bf16.
    "bfloat16": np.array([[0.0, -1.5, 2.0**127], [1.0, np.inf, -2.0**-100]], dtype=np.float32),
}


@pytest.mark.parametrize("name", sorted(_SAMPLES))
def test_tensor_round_trip_every_dtype(name: str) -> None:
    array = _SAMPLES[name]
    tensor = convert.ndarray_to_tensor(array, name)
    assert tensor.dtype == convert.DTYPE_BY_NAME[name]
    assert list(tensor.shape) == list(array.shape)
    back = convert.tensor_to_ndarray(tensor)
    assert back.dtype == (np.float32 if name == "bfloat16" else array.dtype)
    np.testing.assert_array_equal(back, array)


def test_tensor_dtype_inferred_and_little_endian_c_order() -> None:
    array = np.arange(6, dtype=">i4").reshape(2, 3).T  # big-endian and Fortran-ordered view
    tensor = convert.ndarray_to_tensor(array)
    assert tensor.dtype == pb.DATA_TYPE_INT32
    assert tensor.data == np.ascontiguousarray(array).astype("<i4").tobytes()
    np.testing.assert_array_equal(convert.tensor_to_ndarray(tensor), array)


def test_scalar_tensor() -> None:
    tensor = convert.ndarray_to_tensor(np.float32(2.5))
    assert list(tensor.shape) == [] and len(tensor.data) == 4
    assert convert.tensor_to_ndarray(tensor).shape == ()


def test_float64_needs_explicit_dtype() -> None:
    with pytest.raises(ValueError, match="pass dtype"):
        convert.ndarray_to_tensor(np.zeros(3))
    assert convert.ndarray_to_tensor(np.zeros(3), "float32").dtype == pb.DATA_TYPE_FLOAT32


def test_bfloat16_decode_is_exact_bit_shift() -> None:
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001, 0x7FC0, 0x8000], dtype="<u2")
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_BFLOAT16, shape=[6], data=bits.tobytes())
    out = convert.tensor_to_ndarray(tensor)
    assert out.dtype == np.float32
    expected = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    assert out[0] == 1.0 and out[1] == -2.0 and out[2] == np.inf and math.isnan(out[4])
    assert out[3] == np.float32(2.0**-133)  # smallest bf16 subnormal survives exactly


def test_bfloat16_encode_rounds_to_nearest_even() -> None:
    x = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, np.nan], dtype=np.float32)
    bits = convert.float32_to_bfloat16_bits(x)
    assert bits[0] == 0x3F80  # tie rounds to even (down)
    assert bits[1] == 0x3F82  # tie rounds to even (up)
    assert np.isnan(convert.bfloat16_bits_to_float32(bits[2:]))[0]


@pytest.mark.parametrize("delta", [-1, 1])
def test_tensor_byte_length_mismatch_raises(delta: int) -> None:
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT16, shape=[2, 3], data=b"\0" * (12 + delta))
    with pytest.raises(ValueError, match="needs 12 bytes"):
        convert.tensor_to_ndarray(tensor)


def test_tensor_rejects_unspecified_dtype_and_bad_bool() -> None:
    with pytest.raises(ValueError):
        convert.tensor_to_ndarray(pb.Tensor(shape=[1], data=b"\0"))
    with pytest.raises(ValueError, match="BOOL"):
        convert.tensor_to_ndarray(pb.Tensor(dtype=pb.DATA_TYPE_BOOL, shape=[2], data=b"\x00\x02"))


def test_metadata_round_trip() -> None:
    metadata = {
        "ferrum_require_full_logits": True,
        "name": "x",
        "n": 3,
        "ratio": 0.25,
        "none": None,
        "nested": {"list": [1, "a", False, None, {"k": [2.5]}]},
        "np": np.int64(7),
        "tuple": (1, 2),
    }
    msg = pb.DecodeInput()
    convert.metadata_to_proto(metadata, msg.metadata)
    back = convert.metadata_from_proto(msg.metadata)
    assert back == {**metadata, "np": 7, "tuple": [1, 2]}
    assert isinstance(back["ferrum_require_full_logits"], bool)


def test_metadata_rejects_non_str_keys_and_unsupported_values() -> None:
    with pytest.raises(TypeError):
        convert.metadata_to_proto({1: "x"}, pb.DecodeInput().metadata)  # type: ignore[dict-item]
    with pytest.raises(Exception):
        convert.metadata_to_proto({"x": object()}, pb.DecodeInput().metadata)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (LogitsPolicy.full(), pb.LogitsPolicy(full=pb.FullLogits(dtype=pb.DATA_TYPE_FLOAT32))),
        (LogitsPolicy.full("bfloat16"), pb.LogitsPolicy(full=pb.FullLogits(dtype=pb.DATA_TYPE_BFLOAT16))),
        (LogitsPolicy.full("float16"), pb.LogitsPolicy(full=pb.FullLogits(dtype=pb.DATA_TYPE_FLOAT16))),
        (LogitsPolicy.argmax(), pb.LogitsPolicy(argmax=pb.ArgmaxToken())),
        (LogitsPolicy.top_k(5), pb.LogitsPolicy(top_k=pb.TopKLogprobs(k=5))),
        (LogitsPolicy.sample(0.7), pb.LogitsPolicy(sample=pb.SampleToken(temperature=0.7))),
        (
            LogitsPolicy.sample(0.5, top_k=40, top_p=0.9, seed=2**40),
            pb.LogitsPolicy(sample=pb.SampleToken(temperature=0.5, top_k=40, top_p=0.9, seed=2**40)),
        ),
    ],
)
def test_policy_building_and_round_trip(policy: LogitsPolicy, expected: pb.LogitsPolicy) -> None:
    msg = convert.policy_to_proto(policy)
    assert msg == expected
    back = convert.policy_from_proto(msg)
    assert back is not None and back.kind == policy.kind and back.k == policy.k and back.seed == policy.seed
    if policy.top_p is None:
        assert not msg.sample.HasField("top_p") and back.top_p is None
    else:
        assert back.top_p == pytest.approx(policy.top_p)


def test_adjustments_and_min_p_round_trip_and_build_counts_the_tokens() -> None:
    adjust = LogitsAdjustments.build([5, 9, 5, 5], prompt_tokens=[1, 9, 2, 1], repetition_penalty=1.2,
                                     presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={7: -100.0, 3: 2.5},
                                     allowed_token_ids=range(4, 10))
    assert (adjust.penalized_token_ids, adjust.penalized_token_counts) == ((5, 9, 1, 2), (3, 1, 0, 0))
    assert adjust.logit_bias == ((3, 2.5), (7, -100.0)) and adjust.allowed_token_ids == (4, 5, 6, 7, 8, 9)
    assert LogitsAdjustments.build([4, 6]).penalized_token_counts == ()  # each once: no counts on the wire
    for policy in (LogitsPolicy.argmax(adjust), LogitsPolicy.sample(0.8, top_p=0.5, seed=3, min_p=0.25, adjustments=adjust)):
        msg = convert.policy_to_proto(policy)
        assert msg.HasField("adjustments") and dict(msg.adjustments.logit_bias) == {3: 2.5, 7: -100.0}
        back = convert.policy_from_proto(msg)
        assert back is not None and back.adjustments is not None
        assert back.adjustments.repetition_penalty == pytest.approx(1.2)
        assert back.adjustments.penalized_token_counts == (3, 1, 0, 0)
        assert back.min_p == (None if policy.kind == "argmax" else pytest.approx(0.25))
        item = convert.prefill_input_to_proto(PrefillInput([1], logits_policy=policy))
        assert item.logits_policy == msg  # an adjusted argmax is not sent as a bare one
    assert not convert.policy_to_proto(LogitsPolicy.sample(1.0)).sample.HasField("min_p")
    penalized = Penalties(repetition=1.1, frequency=0.5).apply(LogitsPolicy.argmax(adjust), [1, 2], [3, 3])
    assert penalized.adjustments is not None and penalized.adjustments.penalized_token_ids == (3, 1, 2)
    assert penalized.adjustments.allowed_token_ids == adjust.allowed_token_ids  # the bias and allow-list stay
    with pytest.raises(ValueError, match="argmax and sample"):
        Penalties(presence=1.0).apply(LogitsPolicy.full(), [1], [])
    assert not Penalties() and Penalties(repetition=1.0)
    banned = with_banned(LogitsPolicy.argmax(adjust), [2, 9])
    assert banned.adjustments is not None and banned.adjustments.banned_token_ids == (2, 9)
    assert banned.adjustments.logit_bias == adjust.logit_bias  # the rest kept
    back = convert.policy_from_proto(convert.policy_to_proto(banned))
    assert back is not None and back.adjustments is not None and back.adjustments.banned_token_ids == (2, 9)
    assert with_banned(banned, [9, 1]).adjustments.banned_token_ids == (1, 2, 9)


def test_top_logprobs_with_a_chosen_token_round_trip() -> None:
    for policy in (LogitsPolicy.argmax(top_logprobs=3), LogitsPolicy.sample(0.5, seed=1, top_logprobs=4)):
        msg = convert.policy_to_proto(policy)
        assert getattr(msg, policy.kind).top_logprobs == policy.top_logprobs
        assert convert.policy_from_proto(msg) == policy
        item = convert.prefill_input_to_proto(PrefillInput([1], logits_policy=policy))
        assert item.logits_policy == msg  # an argmax with top_logprobs is not sent as a bare one
    out = convert.logits_from_proto(pb.LogitsOutput(kind=pb.LOGITS_KIND_ARGMAX, token_id=7, logprob=-0.5,
                                                    top_token_ids=[7, 2], top_logprobs=[-0.5, -1.5]))
    assert (out.kind, out.token_id, out.logprob, out.sampling_logprob) == ("argmax", 7, -0.5, None)
    assert out.top_token_ids.tolist() == [7, 2] and out.top_logprobs.tolist() == [-0.5, -1.5]
    bare = convert.logits_from_proto(pb.LogitsOutput(kind=pb.LOGITS_KIND_ARGMAX, token_id=7, logprob=-0.5))
    assert bare.top_token_ids is None


def test_policy_unset_is_none_and_bad_dtype_rejected() -> None:
    assert convert.policy_from_proto(pb.LogitsPolicy()) is None
    msg = convert.prefill_input_to_proto(PrefillInput([1]))
    assert not msg.HasField("logits_policy")
    with pytest.raises(ValueError):
        LogitsPolicy.full("float64")  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "cuda:3", "rocm:1", "metal:0", ""])
def test_handle_round_trip(device: str) -> None:
    handle = KvCacheHandle("seq-1", 37, (4, 9, 2), 16, 24, 8, 64, device)
    msg = convert.handle_to_proto(handle)
    assert msg.block_table.sequence_length == 37 and list(msg.block_table.block_ids) == [4, 9, 2]
    assert convert.handle_from_proto(msg) == handle


def test_handle_device_forms() -> None:
    assert convert.device_to_proto("cuda") == pb.Device(type=pb.DEVICE_TYPE_CUDA, index=0)
    assert convert.device_from_proto(pb.Device(type=pb.DEVICE_TYPE_CUDA)) == "cuda:0"
    with pytest.raises(ValueError):
        convert.device_to_proto("tpu:0")
    assert hash(KvCacheHandle("a", 1)) == hash(KvCacheHandle("a", 1))


def test_logits_outputs_of_every_kind() -> None:
    row = np.array([0.5, 2.0, -1.0], dtype=np.float32)
    full = convert.logits_from_proto(
        pb.LogitsOutput(kind=pb.LOGITS_KIND_FULL, logits=convert.ndarray_to_tensor(row, "bfloat16"))
    )
    assert full.kind == "full" and full.logits.dtype == np.float32 and full.next_token() == 1
    half = convert.logits_from_proto(
        pb.LogitsOutput(kind=pb.LOGITS_KIND_FULL, logits=convert.ndarray_to_tensor(row, "float16"))
    )
    assert half.logits.dtype == np.float16
    arg = convert.logits_from_proto(pb.LogitsOutput(kind=pb.LOGITS_KIND_ARGMAX, token_id=7, logprob=-0.5))
    assert (arg.kind, arg.token_id, arg.logprob, arg.sampling_logprob, arg.logits) == ("argmax", 7, -0.5, None, None)
    sample = convert.logits_from_proto(
        pb.LogitsOutput(kind=pb.LOGITS_KIND_SAMPLE, token_id=3, logprob=-1.0, sampling_logprob=-0.25)
    )
    assert sample.next_token() == 3 and sample.sampling_logprob == -0.25
    top = convert.logits_from_proto(
        pb.LogitsOutput(kind=pb.LOGITS_KIND_TOP_K, top_token_ids=[9, 4], top_logprobs=[-0.1, -2.5])
    )
    assert top.next_token() == 9 and top.top_logprobs.dtype == np.float32
    np.testing.assert_array_equal(top.top_token_ids, [9, 4])
    with pytest.raises(ValueError):
        LogitsOutput(kind="top_k").next_token()


def test_requests_accept_lists_and_ndarrays() -> None:
    handle = KvCacheHandle("c", 3)
    msg = convert.prefill_request(
        PrefillInput(
            np.array([5, 6], dtype=np.int64),
            kv_cache=handle,
            position_ids=[3, 4],
            attention_mask=np.ones(2, dtype=np.uint8),
            metadata={"a": 1},
            logits_policy=LogitsPolicy.argmax(),
        )
    ).input
    assert list(msg.input_ids) == [5, 6] and list(msg.position_ids) == [3, 4] and list(msg.attention_mask) == [1, 1]
    assert msg.kv_cache.cache_id == "c" and msg.logits_policy.HasField("argmax")
    with pytest.raises(ValueError):
        convert.prefill_request(PrefillInput(np.array([[1, 2]])))
    with pytest.raises(ValueError):
        convert.prefill_request(PrefillInput(np.array([1.0])))

    dec = convert.decode_request(DecodeInput(4, handle, position_id=3)).input
    assert dec.HasField("token_id") and dec.token_id == 4 and dec.position_id == 3
    assert not convert.decode_request(DecodeInput(0, handle)).input.HasField("position_id")

    item = UnifiedBatchItem("s", [1], 0, True)
    assert convert.unified_decode_request([item]) == convert.unified_decode_request(UnifiedBatch([item]))
    assert convert.truncate_kv_request(handle, 1) == convert.truncate_kv_request("c", 1)
    assert convert.release_cache_request(handle).cache_id == "c"
    fwd = convert.forward_request([1, 2], "token_logprobs", "bfloat16")
    assert fwd.output == pb.FORWARD_OUTPUT_TOKEN_LOGPROBS and fwd.dtype == pb.DATA_TYPE_BFLOAT16
    with pytest.raises(ValueError):
        convert.forward_request([1], "embeddings")


def test_lora_adapter_goes_into_metadata() -> None:
    handle = KvCacheHandle("c", 3)
    key = "ferrum_lora_adapter"
    prefill = convert.prefill_request(PrefillInput([1], lora_adapter="math", metadata={"a": 1})).input
    assert convert.metadata_from_proto(prefill.metadata) == {"a": 1, key: "math"}
    decode = convert.decode_request(DecodeInput(1, handle, lora_adapter="math")).input
    item = convert.unified_item_to_proto(UnifiedBatchItem("s", [1], 0, True, lora_adapter="math"))
    assert decode.metadata[key].string_value == item.metadata[key].string_value == "math"
    assert key not in convert.prefill_request(PrefillInput([1])).input.metadata
    # Naming it both ways is fine when they agree, an error when they do not.
    assert convert.decode_request(DecodeInput(1, handle, metadata={key: "math"}, lora_adapter="math"))
    with pytest.raises(ValueError, match="contradicts"):
        convert.decode_request(DecodeInput(1, handle, metadata={key: "code"}, lora_adapter="math"))


def test_lora_adapter_requests(tmp_path) -> None:
    assert convert.load_lora_adapter_request("a", "dir/a") == pb.LoadLoraAdapterRequest(name="a", path="dir/a")
    assert convert.unload_lora_adapter_request("a") == pb.UnloadLoraAdapterRequest(name="a")
    (tmp_path / "adapter_config.json").write_bytes(b"{}")
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors missing"):
        convert.upload_lora_adapter_request("a", tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    upload = convert.upload_lora_adapter_request("a", str(tmp_path))
    assert upload.WhichOneof("source") == "inline" and upload.name == "a"
    assert (upload.inline.adapter_config_json, upload.inline.adapter_model_safetensors) == (b"{}", b"\x01\x02")


def test_batch_and_unified_responses_share_call_timing() -> None:
    timing = pb.CallTiming(queue_ns=1, executor_ns=2, total_ns=4)
    out = pb.DecodeOutput(
        logits=pb.LogitsOutput(kind=pb.LOGITS_KIND_ARGMAX, token_id=1),
        kv_cache=pb.KvCacheHandle(cache_id="a", block_table=pb.BlockTable(sequence_length=5)),
    )
    results = convert.batch_decode_response(pb.BatchDecodeResponse(outputs=[out, out], timing=timing))
    assert [r.timing.total_ns for r in results] == [4, 4] and results[0].kv_cache.sequence_length == 5
    unified = convert.unified_decode_response(
        pb.UnifiedDecodeResponse(
            results=[pb.UnifiedItemResult(seq_id="a", kv_cache=out.kv_cache), pb.UnifiedItemResult(seq_id="b", logits=out.logits)],
            timing=timing,
        )
    )
    assert unified[0].logits is None and unified[1].logits.token_id == 1 and unified[1].timing.queue_ns == 1
    fwd = convert.forward_response(
        pb.ForwardResponse(output=convert.ndarray_to_tensor(np.zeros((2, 3), np.float32)), timing=timing)
    )
    assert fwd.kind == "logits" and fwd.output.shape == (2, 3)
    assert convert.cache_metrics_response(pb.GetCacheMetricsResponse()) is None
    assert convert.lora_metrics_response(pb.GetLoraMetricsResponse(metrics=pb.LoraMetrics(enabled=True))).enabled
