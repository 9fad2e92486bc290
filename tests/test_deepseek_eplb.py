"""moeplace's numpy DeepSeek EPLB against SGLang 0.5.23's torch original, the README example and invariants."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.algorithms import deepseek
from moeplace.errors import MoeplaceError

torch = pytest.importorskip("torch")


def load_sglang_deepseek():
    """SGLang's own `eplb_algorithms/deepseek.py`, loaded from the installed package by path.

    Importing it as `sglang.srt.eplb.eplb_algorithms.deepseek` runs the package `__init__`s,
    which pull in most of SGLang (about 8 s); the module itself needs only torch.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    path = Path(spec.submodule_search_locations[0], "srt", "eplb", "eplb_algorithms", "deepseek.py")
    if not path.is_file():
        return pytest.importorskip("sglang.srt.eplb.eplb_algorithms.deepseek")
    module_spec = importlib.util.spec_from_file_location("sglang_eplb_deepseek", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


sglang_deepseek = load_sglang_deepseek()

WEIGHT_KINDS = ("float", "tied_integers", "zeros", "skewed")


def make_weight(kind: str, num_layers: int, num_experts: int, seed: int) -> np.ndarray:
    """[L, E] loads of one kind; ties are what tell tie-breaking apart."""
    rng = np.random.default_rng(seed)
    shape = (num_layers, num_experts)
    if kind == "float":
        return rng.random(shape) * 1000
    if kind == "tied_integers":
        return rng.integers(0, 5, shape).astype(np.float64)
    if kind == "zeros":
        return np.zeros(shape)
    if kind == "skewed":
        # A few hot experts over a long tail with many zeros and repeated counts.
        return np.floor(rng.pareto(0.8, shape) * 20) * (rng.random(shape) < 0.8)
    raise ValueError(kind)


def sglang_rebalance(weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical):
    outputs = sglang_deepseek.rebalance_experts(
        torch.from_numpy(np.asarray(weight)), num_replicas, num_groups, num_nodes, num_gpus, hierarchical
    )
    return tuple(t.numpy() for t in outputs)


def assert_same_as_sglang(weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical):
    ours = deepseek.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical)
    theirs = sglang_rebalance(weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical)
    for name, mine, expected in zip(("phy2log", "log2phy", "logcnt"), ours, theirs):
        assert mine.dtype == np.int64, name
        np.testing.assert_array_equal(mine, expected, err_msg=name)


def check_placement(weight, num_replicas, num_gpus, phy2log, log2phy, logcnt):
    """Invariants every EPLB result satisfies, whatever the loads."""
    num_layers, num_experts = np.shape(weight)
    assert phy2log.shape == (num_layers, num_replicas)
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape == (num_layers, num_experts, logcnt.max())
    assert (logcnt >= 1).all()
    assert (logcnt.sum(axis=1) == num_replicas).all()
    for layer in range(num_layers):
        np.testing.assert_array_equal(np.bincount(phy2log[layer], minlength=num_experts), logcnt[layer])
        for expert in range(num_experts):
            slots = log2phy[layer, expert]
            count = logcnt[layer, expert]
            assert (slots[count:] == -1).all()
            assert (phy2log[layer, slots[:count]] == expert).all()
        # Each slot is listed exactly once, under its own expert.
        listed = np.sort(log2phy[layer][log2phy[layer] >= 0])
        np.testing.assert_array_equal(listed, np.arange(num_replicas))


def equality_cases():
    """(E, num_gpus, redundancy, hierarchical, num_nodes, num_groups) for every valid combination."""
    cases = []
    for num_experts in (16, 32, 64, 256):
        for num_gpus in (4, 8, 16):
            for redundancy in (0, 8, 32):
                num_replicas = num_experts + redundancy
                if num_replicas % num_gpus:
                    continue
                cases.append((num_experts, num_gpus, redundancy, False, 1, None))
                for num_nodes in (1, 2, 4):
                    for num_groups in sorted({num_nodes, 8}):
                        if num_groups % num_nodes == 0 and num_experts % num_groups == 0:
                            cases.append((num_experts, num_gpus, redundancy, True, num_nodes, num_groups))
    return cases


@pytest.mark.parametrize(("num_experts", "num_gpus", "redundancy", "hierarchical", "num_nodes", "num_groups"), equality_cases())
def test_equal_to_sglang(num_experts, num_gpus, redundancy, hierarchical, num_nodes, num_groups):
    # Every weight kind at every shape; the layer count cycles so each shape sees 1, 3 and 8.
    for index, kind in enumerate(WEIGHT_KINDS):
        num_layers = (1, 3, 8)[(num_experts + num_gpus + redundancy + num_nodes + index) % 3]
        weight = make_weight(kind, num_layers, num_experts, seed=num_experts * 1000 + num_gpus * 10 + index)
        assert_same_as_sglang(weight, num_experts + redundancy, num_groups, num_nodes, num_gpus, hierarchical)


@pytest.mark.parametrize("num_layers", [1, 3, 8])
@pytest.mark.parametrize("hierarchical", [False, True])
def test_equal_to_sglang_every_layer_count(num_layers, hierarchical):
    weight = make_weight("tied_integers", num_layers, 64, seed=num_layers)
    assert_same_as_sglang(weight, 96, 8, 2, 8, hierarchical)


def test_readme_example():
    """deepseek-ai/EPLB's README example: 2 nodes, 8 GPUs, 4 groups, 16 slots."""
    weight = np.array(
        [
            [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
        ]
    )
    expected_phy2log = np.array(
        [
            [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
            [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
        ]
    )
    phy2log, log2phy, logcnt = deepseek.rebalance_experts(weight, 16, 4, 2, 8, True)
    np.testing.assert_array_equal(phy2log, expected_phy2log)
    np.testing.assert_array_equal(sglang_rebalance(weight, 16, 4, 2, 8, True)[0], expected_phy2log)
    assert_same_as_sglang(weight, 16, 4, 2, 8, True)
    check_placement(weight, 16, 8, phy2log, log2phy, logcnt)


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_phases_equal_to_sglang(kind):
    weight32 = make_weight(kind, 6, 48, seed=7).astype(np.float32)
    for ours, theirs in zip(
        deepseek.replicate_experts(weight32, 64), sglang_deepseek.replicate_experts(torch.from_numpy(weight32), 64)
    ):
        np.testing.assert_array_equal(ours, theirs.numpy())
    for num_packs in (2, 3, 8, 48):
        for ours, theirs in zip(
            deepseek.balanced_packing(weight32, num_packs),
            sglang_deepseek.balanced_packing(torch.from_numpy(weight32), num_packs),
        ):
            np.testing.assert_array_equal(ours, theirs.numpy())


def adversarial_keys(num_items: int) -> np.ndarray:
    """Tied keys that push libstdc++'s introsort past its depth limit into heapsort.

    McIlroy's "antiqsort" adversary played against our replay, with every two frozen values
    merged into one so that the heapsort also meets ties.
    """
    gas = 10 * num_items
    value = [gas] * num_items
    state = {"frozen": 0, "candidate": -1}

    def compare(x, y):
        if value[x] == gas and value[y] == gas:
            frozen = x if x == state["candidate"] else y
            value[frozen] = state["frozen"] // 2
            state["frozen"] += 1
        if value[x] == gas:
            state["candidate"] = x
        elif value[y] == gas:
            state["candidate"] = y
        return value[x] - value[y]

    class Key:
        def __init__(self, index):
            self.index = index

        def __gt__(self, other):
            return compare(self.index, other.index) > 0

    deepseek._libstdcxx_sort_descending([Key(i) for i in range(num_items)])
    return np.array(value, dtype=np.float32)


@pytest.mark.parametrize("num_items", [40, 257, 600])
def test_sort_matches_torch_in_heapsort_fallback(num_items, monkeypatch):
    keys = adversarial_keys(num_items)
    heapsorts = []
    real_heap_sort = deepseek._heap_sort
    monkeypatch.setattr(deepseek, "_heap_sort", lambda *args: heapsorts.append(1) or real_heap_sort(*args))
    order = deepseek._sort_descending_like_torch(keys[None])[0]
    assert heapsorts, "the adversarial input should reach the heapsort fallback"
    expected = torch.from_numpy(keys[None]).sort(-1, descending=True).indices.numpy()[0]
    np.testing.assert_array_equal(order, expected)


@pytest.mark.parametrize("num_items", [1, 2, 16, 17, 31, 64, 255, 288, 1000])
def test_sort_matches_torch_on_ties(num_items):
    rng = np.random.default_rng(num_items)
    keys = np.concatenate(
        [
            rng.integers(0, 3, (4, num_items)),
            np.zeros((1, num_items)),
            np.sort(rng.integers(0, 5, (1, num_items))),
            -np.sort(-rng.integers(0, 5, (1, num_items))),
        ]
    ).astype(np.float32)
    expected = torch.from_numpy(keys).sort(-1, descending=True).indices.numpy()
    np.testing.assert_array_equal(deepseek._sort_descending_like_torch(keys), expected)


@st.composite
def problems(draw):
    num_nodes = draw(st.sampled_from([1, 2, 4]))
    num_gpus = num_nodes * draw(st.integers(1, 4))
    num_groups = num_nodes * draw(st.integers(1, 3))
    num_experts = num_groups * draw(st.integers(1, 4))
    slots_per_gpu = draw(st.integers(-(-num_experts // num_gpus), -(-num_experts // num_gpus) + 3))
    num_layers = draw(st.integers(1, 3))
    weight = draw(
        st.lists(
            st.lists(st.integers(0, 6) | st.floats(0, 1e6, width=32), min_size=num_experts, max_size=num_experts),
            min_size=num_layers,
            max_size=num_layers,
        )
    )
    hierarchical = draw(st.booleans())
    return np.array(weight, dtype=np.float64), slots_per_gpu * num_gpus, num_groups, num_nodes, num_gpus, hierarchical


@settings(max_examples=60, deadline=None)
@given(problems())
def test_placement_invariants(problem):
    weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical = problem
    phy2log, log2phy, logcnt = deepseek.rebalance_experts(
        weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical
    )
    check_placement(weight, num_replicas, num_gpus, phy2log, log2phy, logcnt)
    if hierarchical:
        # Replicas never leave the node their group was packed onto.
        num_experts = weight.shape[1]
        group_of_slot = phy2log // (num_experts // num_groups)
        node_of_slot = np.arange(num_replicas) // (num_replicas // num_nodes)
        for layer in range(weight.shape[0]):
            nodes_of_group = {}
            for group, node in zip(group_of_slot[layer], node_of_slot):
                assert nodes_of_group.setdefault(group, node) == node


@pytest.mark.parametrize(
    ("shape", "num_replicas", "num_groups", "num_nodes", "num_gpus", "hierarchical", "message"),
    [
        ((2, 16), 20, 4, 1, 8, False, "not divisible by num_gpus"),
        ((2, 16), 24, 4, 3, 8, False, "num_gpus .8. is not divisible by num_nodes"),
        ((2, 16), 24, 2, 4, 8, True, "num_groups .2. is not divisible by num_nodes"),
        ((2, 16), 24, 3, 1, 8, True, "not divisible by num_groups"),
        ((2, 16), 8, 4, 1, 8, False, "smaller than the number of experts"),
        ((2, 16), 0, 4, 1, 8, False, "num_replicas must be a positive integer"),
        ((16,), 16, 4, 1, 8, False, "layers, experts"),
    ],
)
def test_impossible_inputs_raise(shape, num_replicas, num_groups, num_nodes, num_gpus, hierarchical, message):
    with pytest.raises(MoeplaceError, match=message):
        deepseek.rebalance_experts(np.ones(shape), num_replicas, num_groups, num_nodes, num_gpus, hierarchical)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_malformed_weight_raises(bad):
    weight = np.ones((2, 16))
    weight[1, 3] = bad
    with pytest.raises(MoeplaceError, match="weight"):
        deepseek.rebalance_experts(weight, 16, 4, 1, 8, False)
