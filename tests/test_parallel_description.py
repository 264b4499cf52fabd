"""How many tensor-parallel ranks serve, on which devices, and each rank's memory: the
executor types, their conversion to modelexec.v1 (ModelInfo.parallel,
ExecutorCapabilities.tensor_parallel_size, ExecutorStatus.ranks), what the client reads,
and the per-rank Prometheus gauges. Unit-level, plus one look at a single-process server."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from client import ExecutorClient
from executors import descriptions as desc
from executors import types as t
from generated.modelexec.v1 import executor_pb2 as pb
from service import convert_describe
from service.metrics import RANK_MEMORY_KINDS, ServiceMetrics

LAYOUT = desc.ParallelLayout(
    tensor_parallel_size=2,
    backend="nccl",
    launcher="spawn",
    ranks=(desc.RankInfo(rank=0, device="cuda:0", host="node-a", pid=4100),
           desc.RankInfo(rank=1, device="cuda:1", host="node-a", pid=4101)),
)
RANKS = (
    desc.RankMemory(rank=0, parameter_bytes=3 << 30, kv_pool_bytes=1 << 30, lora_bytes=4096,
                 device_allocated_bytes=5 << 30, device_peak_bytes=6 << 30),
    desc.RankMemory(rank=1, parameter_bytes=(3 << 30) + 1, kv_pool_bytes=(1 << 30) + 2, lora_bytes=4097,
                 device_allocated_bytes=(5 << 30) + 3, device_peak_bytes=(6 << 30) + 4),
)


def model_info(parallel: desc.ParallelLayout | None = None) -> desc.ModelInfo:
    return desc.ModelInfo(
        model_id="m", model_type=desc.ModelType.QWEN, model_type_name="", num_parameters=10, hidden_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100, max_sequence_length=128,
        dtype=t.DType.BFLOAT16, device="cuda:0", parallel=parallel,
    )


def capabilities(tensor_parallel_size: int = 1) -> desc.ExecutorCapabilities:
    kwargs = {} if tensor_parallel_size == 1 else {"tensor_parallel_size": tensor_parallel_size}
    return desc.ExecutorCapabilities(
        max_batch_size=8, max_sequence_length=128, attention_mechanisms=(desc.AttentionType.PAGED,),
        supports_dynamic_batching=True, supports_continuous_batching=True, supports_speculative_decoding=False,
        supports_tensor_parallelism=tensor_parallel_size > 1, supports_pipeline_parallelism=False,
        supported_dtypes=(t.DType.BFLOAT16,), supported_devices=("cuda",),
        memory_requirements=desc.MemoryRequirements(1, 2, 3, 4), kv_capacity=None,
        supports_native_unified_decode=True, kv_block_size=16, kv_total_blocks=64, **kwargs,
    )


def status(ranks: tuple[desc.RankMemory, ...] = ()) -> desc.ExecutorStatus:
    return desc.ExecutorStatus(
        state=desc.ExecutorState.READY, is_ready=True, current_batch_size=0, prefill_operations=0,
        decode_operations=0, avg_prefill_time_ms=0.0, avg_decode_time_ms=0.0,
        memory_usage=desc.MemoryUsage(1, 1, 1, 100.0), last_operation_unix_s=None,
        kv_pool=desc.KvPoolStatus(64, 0, 64, 16, 0, 0, 0), ranks=ranks,
    )


def over_the_wire(message):
    """What a client parses: the message serialized and read back."""
    return type(message).FromString(message.SerializeToString())


# -- executor types -------------------------------------------------------------------------
def test_the_defaults_describe_one_process():
    assert model_info().parallel is None
    assert capabilities().tensor_parallel_size == 1
    assert status().ranks == ()
    layout = desc.ParallelLayout()
    assert (layout.tensor_parallel_size, layout.backend, layout.launcher, layout.ranks) == (1, "", "", ())


# -- service conversion, read back as the client reads it ----------------------------------
def test_model_info_carries_the_layout():
    info = over_the_wire(convert_describe.model_info(model_info(LAYOUT)))
    p = info.parallel
    assert (p.tensor_parallel_size, p.backend, p.launcher) == (2, "nccl", "spawn")
    assert [(r.rank, r.device.type, r.device.index, r.host, r.pid) for r in p.ranks] == [
        (0, pb.DEVICE_TYPE_CUDA, 0, "node-a", 4100), (1, pb.DEVICE_TYPE_CUDA, 1, "node-a", 4101)]


def test_a_single_process_reports_size_one_and_no_ranks():
    info = over_the_wire(convert_describe.model_info(model_info(None)))
    assert info.HasField("parallel")
    assert info.parallel == pb.ParallelLayout(tensor_parallel_size=1)
    limits = pb.ServiceLimits()
    assert over_the_wire(convert_describe.capabilities(capabilities(), limits)).tensor_parallel_size == 1
    assert list(over_the_wire(convert_describe.status(status())).ranks) == []


def test_capabilities_carry_the_size():
    caps = over_the_wire(convert_describe.capabilities(capabilities(4), pb.ServiceLimits()))
    assert caps.tensor_parallel_size == 4 and caps.supports_tensor_parallelism


def test_status_carries_each_ranks_memory():
    ranks = over_the_wire(convert_describe.status(status(RANKS))).ranks
    assert [(r.rank, r.parameter_bytes, r.kv_pool_bytes, r.lora_bytes, r.device_allocated_bytes,
             r.device_peak_bytes) for r in ranks] == [
        (m.rank, m.parameter_bytes, m.kv_pool_bytes, m.lora_bytes, m.device_allocated_bytes, m.device_peak_bytes)
        for m in RANKS]


# -- a real single-process server ----------------------------------------------------------
def test_a_single_process_server_says_so(client: ExecutorClient):
    info = client.info()
    assert info.parallel.tensor_parallel_size == 1
    assert (info.parallel.backend, info.parallel.launcher, list(info.parallel.ranks)) == ("", "", [])
    assert client.capabilities().tensor_parallel_size == 1
    assert list(client.status().ranks) == []


# -- Prometheus -------------------------------------------------------------------------------
class FakeExecutor:
    def __init__(self, s: desc.ExecutorStatus) -> None:
        self._status = s

    def status(self) -> desc.ExecutorStatus:
        return self._status


def samples(executor: FakeExecutor) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(ServiceMetrics(executor).registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_each_rank_has_its_memory_gauges():
    m = samples(FakeExecutor(status(RANKS)))
    rank_series = {key: value for key, value in m.items() if key[0] == "modelexec_rank_memory_bytes"}
    assert len(rank_series) == len(RANKS) * len(RANK_MEMORY_KINDS) == 10
    for r in RANKS:
        for kind, attr in RANK_MEMORY_KINDS:
            assert rank_series[("modelexec_rank_memory_bytes", (("kind", kind), ("rank", str(r.rank))))] \
                == getattr(r, attr)
    assert m[("modelexec_kv_blocks_total", ())] == 64  # the pool gauges still come from the same status


def test_a_single_process_has_no_rank_gauges():
    m = samples(FakeExecutor(status()))
    assert not [key for key in m if key[0].startswith("modelexec_rank_")]
    assert m[("modelexec_kv_blocks_free", ())] == 64
