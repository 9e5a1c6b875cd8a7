"""The exact weight-sync check's digest (vlrft/engines/weight_digest.py): what it must see and
what it must add up over, computed by hand where it can be."""

import pytest
import torch

from vlrft.engines.weight_digest import (
    DigestCheck,
    WeightDigestError,
    add_digests,
    digest_problem,
    tensor_digest,
)

LANE = (1 << 32) - 1


def signed32(value: int) -> int:
    value &= (1 << 32) - 1
    return value - (1 << 32) if value >= (1 << 31) else value


def reference_y(bits: int) -> int:
    """y of one element's float32 bits, in Python's integers: m = bits * 0x9E3779B1 mod 2^32,
    then m xor (m >> 16) with the sign-extending shift of a signed 32-bit integer."""
    m = signed32(bits * 0x9E3779B1)
    return signed32(m ^ (m >> 16))


def test_digest_is_two_wrapping_sums_of_each_elements_mixed_float32_bits():
    values = torch.tensor([1.0, -2.5, 3.0e-8, 0.0, -0.0])
    bits = values.view(torch.int32).tolist()
    assert bits[:2] == [0x3F800000, signed32(0xC0200000)]  # IEEE 754 by hand
    ys = [reference_y(b) for b in bits]
    s1, s2 = sum(ys) & LANE, sum(y * y for y in ys) & LANE
    assert reference_y(0) == 0 and reference_y(0x3F800000) != 0
    assert tensor_digest(values) == s1 | (s2 << 32)
    assert tensor_digest(torch.zeros(7)) == 0  # padding adds nothing


def test_digest_adds_up_over_pieces_in_any_order():
    weight = torch.randn(300, 17)
    whole = tensor_digest(weight)
    assert whole == tensor_digest(weight[torch.randperm(300)])  # rows of a fused tensor in another order
    assert whole == add_digests(tensor_digest(weight[:100]), tensor_digest(weight[100:]))  # two shards
    assert whole == add_digests(whole, tensor_digest(torch.zeros(64, 17)))  # zero padding rows
    assert tensor_digest(weight, torch.float32) == whole
    assert add_digests(LANE, 1) == 0 and add_digests(LANE << 32, 1 << 32) == 0  # each lane wraps on its own


def test_digest_sees_one_ulp_and_rounding():
    weight = torch.randn(64, 64)
    nudged = weight.clone()
    nudged[3, 7] = torch.nextafter(nudged[3, 7], torch.tensor(float("inf")))
    assert tensor_digest(nudged) != tensor_digest(weight)
    half = weight.to(torch.bfloat16)
    assert tensor_digest(weight, torch.bfloat16) == tensor_digest(half) == tensor_digest(half.float())
    assert tensor_digest(half) != tensor_digest(weight)


def test_digest_of_a_large_tensor_spans_its_chunks():
    weight = torch.randn((1 << 24) + 5)  # more than one chunk
    assert tensor_digest(weight) == add_digests(tensor_digest(weight[:1000]), tensor_digest(weight[1000:]))


def test_problem_names_stale_changed_absent_and_unsent_tensors():
    sent = {"a": 1, "b": 2, "c": 3}
    assert digest_problem(sent, {"a": 1, "b": 2, "c": 3}, {}, "hf", "after step 1") == ""
    line = digest_problem(sent, {"a": 1, "b": 20, "d": 4, "e": 5}, {"b": 20}, "hf", "after step 4")
    assert "\n" not in line
    assert line.startswith("weight sync check after step 4: the 'hf' engine does not serve the 3 tensors")
    assert "1 still hold the previous sync's values ('b')" in line
    assert "1 sent are not in the engine ('c')" in line
    assert "2 of the engine's were not sent ('d', 'e')" in line
    rounded = digest_problem(sent, {"a": 1, "b": 2, "c": 30}, {"c": 3}, "vllm", "at weights version 2")
    assert "1 hold other values than were sent, e.g. rounded ('c')" in rounded
    many = digest_problem({f"t{i}": i for i in range(10)}, {f"t{i}": -1 for i in range(10)}, {}, "hf", "after step 1")
    assert "('t0', 't1', 't2' and 7 more)" in many


class FakeEngine:
    """A test double holding named tensors; `drop` names the tensors its update skips and
    `round_to` one it stores through bfloat16."""

    weight_dtype = torch.float32

    def __init__(self, drop=(), round_to=""):
        self.weights = {"w": torch.zeros(4), "v": torch.ones(3)}
        self.drop, self.round_to = drop, round_to

    def update_weights(self, named_tensors):
        for name, tensor in named_tensors:
            if name in self.drop:
                continue
            self.weights[name] = tensor.to(torch.bfloat16).float() if name == self.round_to else tensor.clone()

    def served_digests(self):
        return {name: tensor_digest(tensor) for name, tensor in self.weights.items()}

    def expected_digests(self, sent):
        return sent


def new_weights(scale: float):
    return [("w", torch.randn(4) * scale), ("v", torch.randn(3) * scale)]


def test_check_passes_a_full_sync_and_stops_a_partial_one():
    healthy = DigestCheck(FakeEngine(), "fake")
    healthy.update(new_weights(1.0), "after step 1")
    healthy.update(iter(()), "after step 2")  # a version without tensors: nothing to check
    with pytest.raises(WeightDigestError, match=r"after step 1: .* 1 still hold the previous sync's values \('v'\)"):
        DigestCheck(FakeEngine(drop={"v"}), "fake").update(new_weights(1.0), "after step 1")
    with pytest.raises(WeightDigestError, match=r"other values than were sent, e.g. rounded \('w'\)"):
        DigestCheck(FakeEngine(round_to="w"), "fake").update(new_weights(1.0), "after step 1")


def test_check_is_off_when_asked_or_without_engine_digests():
    DigestCheck(FakeEngine(drop={"v"}), "fake", enabled=False).update(new_weights(1.0), "after step 1")
    assert not DigestCheck(object(), "delivery").enabled
