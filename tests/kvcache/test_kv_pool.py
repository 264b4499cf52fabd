"""PagedKvPool: tensor shapes, write / read round trips, layer isolation, byte arithmetic."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvcache import BlockTable  # noqa: E402
from kvcache.kv_pool import PagedKvPool  # noqa: E402

L, NB, BS, H, D = 3, 8, 4, 2, 5


def make(dtype=torch.float32) -> PagedKvPool:
    return PagedKvPool(L, NB, BS, H, D, dtype=dtype, device="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_shapes_dtype_device(dtype) -> None:
    pool = make(dtype)
    assert len(pool.key) == len(pool.value) == L
    for t in (*pool.key, *pool.value):
        assert t.shape == (NB, BS, H, D)
        assert t.dtype == dtype
        assert t.device == torch.device("cpu")
        assert torch.count_nonzero(t) == 0
    assert pool.device == torch.device("cpu")
    assert pool.dtype == dtype
    k, v = pool.flat(1)
    assert k.shape == v.shape == (NB * BS, H, D)


def test_device_accepts_torch_device() -> None:
    pool = PagedKvPool(1, 2, 2, 1, 1, device=torch.device("cpu"))
    assert pool.key[0].device.type == "cpu"


def test_key_value_and_layers_are_distinct_storage() -> None:
    pool = make()
    pool.key[0].fill_(1.0)
    assert torch.count_nonzero(pool.value[0]) == 0
    assert all(torch.count_nonzero(pool.key[i]) == 0 for i in range(1, L))


def rand(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, H, D, generator=gen)


def test_round_trip_at_arbitrary_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = make()
    slots = torch.tensor([31, 0, 17, 5, 22, 3], dtype=torch.int64)
    k, v = rand(6, gen), rand(6, gen)
    pool.write(1, slots, k, v)
    rk, rv = pool.read(1, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    # Read back in another order.
    perm = torch.tensor([2, 0, 5])
    rk, rv = pool.read(1, slots[perm])
    assert torch.equal(rk, k[perm]) and torch.equal(rv, v[perm])
    # The written slots land at [block, offset] of the 4-d view.
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(pool.key[1][s // BS, s % BS], k[i])
        assert torch.equal(pool.value[1][s // BS, s % BS], v[i])
    # Untouched slots stay zero.
    others = torch.tensor(sorted(set(range(NB * BS)) - set(slots.tolist())))
    ok, ov = pool.read(1, others)
    assert torch.count_nonzero(ok) == 0 and torch.count_nonzero(ov) == 0


def test_round_trip_through_block_table_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    pool = make()
    table = BlockTable(BS, [6, 1, 4])
    slots = torch.tensor(table.slots(0, 10), dtype=torch.int64)
    k, v = rand(10, gen), rand(10, gen)
    pool.write(0, slots, k, v)
    assert torch.equal(pool.key[0][6].reshape(BS, H, D), k[0:4])
    assert torch.equal(pool.key[0][1], k[4:8])
    assert torch.equal(pool.value[0][4, :2], v[8:10])
    # Appending later positions does not disturb earlier ones.
    k2, v2 = rand(2, gen), rand(2, gen)
    pool.write(0, torch.tensor(table.slots(10, 12)), k2, v2)
    rk, rv = pool.read(0, torch.tensor(table.slots(0, 12)))
    assert torch.equal(rk, torch.cat([k, k2])) and torch.equal(rv, torch.cat([v, v2]))


def test_overwrite_slot() -> None:
    gen = torch.Generator().manual_seed(2)
    pool = make()
    s = torch.tensor([9])
    pool.write(2, s, rand(1, gen), rand(1, gen))
    k, v = rand(1, gen), rand(1, gen)
    pool.write(2, s, k, v)
    rk, rv = pool.read(2, s)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_write_to_one_layer_leaves_others_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    pool = make()
    slots = torch.arange(NB * BS)
    ks = [rand(NB * BS, gen) for _ in range(L)]
    vs = [rand(NB * BS, gen) for _ in range(L)]
    for layer in range(L):
        pool.write(layer, slots, ks[layer], vs[layer])
    pool.write(1, torch.tensor([7, 8]), torch.zeros(2, H, D), torch.ones(2, H, D))
    for layer in (0, 2):
        rk, rv = pool.read(layer, slots)
        assert torch.equal(rk, ks[layer]) and torch.equal(rv, vs[layer])
    rk, rv = pool.read(1, slots)
    assert torch.count_nonzero(rk[7:9]) == 0 and torch.all(rv[7:9] == 1)
    assert torch.equal(rk[:7], ks[1][:7]) and torch.equal(rk[9:], ks[1][9:])


def test_write_casts_to_pool_dtype() -> None:
    pool = make(torch.float16)
    k = torch.full((1, H, D), 1.5, dtype=torch.float32)
    v = torch.full((1, H, D), -2.25, dtype=torch.float64)
    pool.write(0, torch.tensor([3]), k, v)
    rk, rv = pool.read(0, torch.tensor([3]))
    assert rk.dtype == rv.dtype == torch.float16
    assert torch.all(rk == 1.5) and torch.all(rv == -2.25)


@pytest.mark.parametrize(
    ("dtype", "size"), [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2), (torch.float64, 8)]
)
def test_byte_arithmetic(dtype, size: int) -> None:
    pool = make(dtype)
    assert pool.bytes_per_token == 2 * L * H * D * size
    assert pool.bytes_per_block == 2 * L * H * D * size * BS
    assert pool.total_bytes == 2 * L * NB * BS * H * D * size
    assert pool.total_bytes == pool.bytes_per_block * NB
    actual = sum(t.numel() * t.element_size() for t in (*pool.key, *pool.value))
    assert pool.total_bytes == actual


def test_scratch_block_follows_the_allocators_blocks() -> None:
    """Padding rows of a fixed-shape step write into the scratch block, never into a real one."""
    pool = PagedKvPool(L, NB, BS, H, D, scratch_blocks=1)
    assert make().scratch_block is None
    assert pool.scratch_block == NB and pool.num_blocks == NB
    assert pool.key[0].shape == (NB + 1, BS, H, D)
    assert pool.total_bytes == pool.bytes_per_block * (NB + 1)
    slots = torch.arange(pool.scratch_block * BS, (pool.scratch_block + 1) * BS)
    ones = torch.ones(BS, H, D)
    for layer in range(L):
        pool.write(layer, slots, ones, ones)
    for layer in range(L):
        assert torch.count_nonzero(pool.key[layer][:NB]) == 0
        assert torch.count_nonzero(pool.value[layer][:NB]) == 0
        assert torch.equal(pool.key[layer][NB], ones)


def test_a_pool_whose_values_are_its_keys_holds_one_half() -> None:
    """DeepSeek's latent rows are their own values: K alone, V the same tensors; V writes are
    dropped (they equal K), reads, views and block copies of V give K's, and the bytes halve."""
    pool = PagedKvPool(L, NB, BS, H, D, values_are_keys=True)
    plain = make()
    assert pool.total_bytes * 2 == plain.total_bytes and pool.bytes_per_token * 2 == plain.bytes_per_token
    assert all(v is k for k, v in zip(pool.key, pool.value))
    slots = torch.tensor([0, 5, 13])
    k = torch.randn(3, H, D)
    pool.write(1, slots, k, torch.full_like(k, 7.0))
    got_k, got_v = pool.read(1, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, k)
    layers = torch.randn(2, 3, H, D)
    pool.write_layers(0, slots, layers, torch.zeros_like(layers))
    vk, vv = pool.view_layers(0, 2, 0, NB * BS)
    assert torch.equal(vk[:, slots], layers) and torch.equal(vv[:, slots], layers)
    pool.copy_blocks([(1, 6)])  # slot 5 is in block 1
    assert torch.equal(pool.read(0, torch.tensor([6 * BS + 1]))[1], layers[0, 1:2])
