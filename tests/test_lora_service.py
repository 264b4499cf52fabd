"""LoRA adapter RPCs at the service and client level, without a real LoRA executor.

The paged test executor has no LoRA support, so the RPCs answer UNIMPLEMENTED there; request
validation (service/convert.py) runs before the executor is called, so it is tested there
too. A small in-memory registry on top of the paged executor checks the success path: what
reaches the executor and how its answer comes back.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from client import (
    AlreadyExistsError,
    AsyncExecutorClient,
    ExecutorClient,
    ExecutorError,
    NotFoundError,
    PrefillInput,
    UnimplementedError,
    from_rpc_error,
)
from client import convert as client_convert
from client.__main__ import main as cli_main
from executors import descriptions as desc
from executors.errors import AlreadyExists, InvalidParameter, NotFound
from executors.paged import PagedAttentionExecutor
from generated.modelexec.v1 import executor_pb2 as pb
from service import convert

C = grpc.StatusCode


def raw_load(client: ExecutorClient, request: pb.LoadLoraAdapterRequest) -> ExecutorError:
    """Send a request the typed client would not build; return the typed error."""
    with pytest.raises(grpc.RpcError) as info:
        client.stub.LoadLoraAdapter(request, timeout=10)
    return from_rpc_error(info.value)


def write_adapter(directory, config: bytes = b'{"r": 4}', weights: bytes = b"weights") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_bytes(config)
    (directory / "adapter_model.safetensors").write_bytes(weights)


# -- an executor without LoRA --------------------------------------------------------------
def test_rpcs_are_unimplemented_without_lora_support(client):
    for call in (lambda: client.list_lora_adapters(), lambda: client.load_lora_adapter("a", "a"),
                 lambda: client.unload_lora_adapter("a")):
        with pytest.raises(UnimplementedError) as info:
            call()
        assert "paged executor has no LoRA support" in info.value.details_message


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.LoadLoraAdapterRequest(name="", path="a"), "name"),
        (pb.LoadLoraAdapterRequest(name="a/b", path="a"), "name"),
        (pb.LoadLoraAdapterRequest(name="with space", path="a"), "name"),
        (pb.LoadLoraAdapterRequest(name="x" * 129, path="a"), "name"),
        (pb.LoadLoraAdapterRequest(name="a"), "source"),
        (pb.LoadLoraAdapterRequest(name="a", path=""), "path"),
        (pb.LoadLoraAdapterRequest(name="a", inline=pb.InlineLoraAdapter(adapter_model_safetensors=b"w")),
         "inline.adapter_config_json"),
        (pb.LoadLoraAdapterRequest(name="a", inline=pb.InlineLoraAdapter(adapter_config_json=b"{}")),
         "inline.adapter_model_safetensors"),
    ],
    ids=["empty_name", "slash", "space", "long_name", "no_source", "empty_path", "no_config", "no_weights"],
)
def test_load_requests_are_validated_before_the_executor(client, request_, field):
    err = raw_load(client, request_)
    assert err.code == C.INVALID_ARGUMENT, err
    assert err.metadata["field"] == field and field.split(".")[-1] in err.details_message


def test_longest_name_and_every_allowed_character_pass_validation(client):
    for name in ("x" * 128, "Az09._:-"):
        with pytest.raises(UnimplementedError):
            client.load_lora_adapter(name, "a")


def test_unload_checks_the_name_too(client):
    with pytest.raises(ExecutorError) as info:
        client.unload_lora_adapter("")
    assert info.value.code == C.INVALID_ARGUMENT and info.value.metadata["field"] == "name"


def test_upload_with_an_empty_file_is_refused_by_the_server(client, tmp_path):
    write_adapter(tmp_path / "empty", weights=b"")
    with pytest.raises(ExecutorError) as info:
        client.upload_lora_adapter("a", tmp_path / "empty")
    assert info.value.code == C.INVALID_ARGUMENT
    assert info.value.metadata["field"] == "inline.adapter_model_safetensors"


def test_upload_of_a_missing_directory_fails_in_the_client(client, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json, adapter_model.safetensors missing"):
        client.upload_lora_adapter("a", tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"half is not a PEFT adapter directory: adapter_model.safetensors"):
        asyncio.run(AsyncExecutorClient(client.target).upload_lora_adapter("a", tmp_path / "half"))


def test_cli_reports_a_missing_directory(paged_server, tmp_path, capsys):
    assert cli_main(["--target", paged_server.address, "lora-load", "a", "--upload", str(tmp_path / "x")]) == 1
    assert "is not a PEFT adapter directory" in capsys.readouterr().err
    assert cli_main(["--target", paged_server.address, "lora-list"]) == 1
    assert "no LoRA support" in capsys.readouterr().err


# -- request metadata ----------------------------------------------------------------------
def _metadata(values: dict) -> dict:
    msg = pb.PrefillInput()
    client_convert.metadata_to_proto(values, msg.metadata)
    return convert.metadata(msg.metadata, "input.metadata")


def test_adapter_name_alone_is_accepted_and_an_empty_one_or_a_bare_path_refused():
    assert _metadata({"ferrum_lora_adapter": "a"}) == {"ferrum_lora_adapter": "a"}
    both = {"ferrum_lora_adapter": "a", "ferrum_lora_path": "p"}
    assert _metadata(both) == both
    with pytest.raises(InvalidParameter) as info:
        _metadata({"ferrum_lora_adapter": ""})
    assert info.value.field == "input.metadata.ferrum_lora_adapter"
    # A path without a name would silently run on the base model.
    with pytest.raises(InvalidParameter) as info:
        _metadata({"ferrum_lora_path": "p"})
    assert info.value.field == "input.metadata.ferrum_lora_path"


def test_a_request_naming_an_unknown_adapter_gets_not_found(client):
    # Past the metadata checks, the executor decides: it has no adapter of that name.
    with pytest.raises(NotFoundError, match="'absent'"):
        client.prefill(PrefillInput([1, 2], lora_adapter="absent"))
    assert client.status().kv_pool.active_caches == 0


# -- the success path, through a stand-in registry -----------------------------------------
class RegistryExecutor(PagedAttentionExecutor):
    """Keeps what LoadLoraAdapter received; adapters are never applied."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[str, desc.LoraSource] = {}

    def _info(self, name: str) -> desc.LoraAdapterInfo:
        return desc.LoraAdapterInfo(name=name, rank=8, alpha=16.0, scaling=2.0, target_modules=("q_proj", "v_proj"),
                                 source=self.sources[name].path or "inline", num_parameters=1024, bytes=4096,
                                 bound_caches=0, loaded_at_unix_s=1_700_000_000.5)

    async def load_lora_adapter(self, name: str, source: desc.LoraSource) -> desc.LoraAdapterInfo:
        if name in self.sources:
            raise AlreadyExists(f"a LoRA adapter named {name!r} is loaded already", field="name")
        self.sources[name] = source
        return self._info(name)

    async def unload_lora_adapter(self, name: str) -> desc.LoraAdapterInfo:
        if name not in self.sources:
            raise NotFound(f"no LoRA adapter named {name!r} is loaded", field="name")
        info = self._info(name)
        del self.sources[name]
        return info

    def list_lora_adapters(self) -> list[desc.LoraAdapterInfo]:
        return [self._info(n) for n in sorted(self.sources)]


def test_load_list_unload_round_trip(make_server, tmp_path, capsys):
    executor = RegistryExecutor()
    running = make_server(instance=executor)
    write_adapter(tmp_path / "local", config=b'{"r": 8}', weights=b"\x00" * 100)
    with ExecutorClient(running.address, timeout=30) as ex:
        info = ex.load_lora_adapter("math", "adapters/math")
        assert isinstance(info, pb.LoraAdapterInfo)
        assert (info.name, info.rank, info.alpha, info.scaling) == ("math", 8, 16.0, 2.0)
        assert list(info.target_modules) == ["q_proj", "v_proj"] and info.source == "adapters/math"
        assert info.loaded_at.ToNanoseconds() == 1_700_000_000_500_000_000
        assert executor.sources["math"] == desc.LoraSource(path="adapters/math")

        assert ex.upload_lora_adapter("code:v1", tmp_path / "local").source == "inline"
        assert executor.sources["code:v1"] == desc.LoraSource(config_json=b'{"r": 8}', safetensors=b"\x00" * 100)
        with pytest.raises(AlreadyExistsError):
            ex.load_lora_adapter("math", "elsewhere")

        assert [a.name for a in ex.list_lora_adapters()] == ["code:v1", "math"]
        assert ex.unload_lora_adapter("math").name == "math"
        with pytest.raises(NotFoundError):
            ex.unload_lora_adapter("math")

    assert cli_main(["--target", running.address, "lora-load", "m2", "--path", "adapters/m2"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "adapters/m2"
    assert cli_main(["--target", running.address, "lora-list"]) == 0
    assert [a["name"] for a in json.loads(capsys.readouterr().out)["adapters"]] == ["code:v1", "m2"]
    assert cli_main(["--target", running.address, "lora-unload", "m2"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "m2"

    async def drive() -> None:
        async with AsyncExecutorClient(running.address) as ex:
            assert (await ex.load_lora_adapter("a", "p")).name == "a"
            assert (await ex.upload_lora_adapter("b", tmp_path / "local")).source == "inline"
            assert [a.name for a in await ex.list_lora_adapters()] == ["a", "b", "code:v1"]
            assert (await ex.unload_lora_adapter("b")).name == "b"

    asyncio.run(drive())
