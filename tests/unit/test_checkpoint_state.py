"""tensor_state of an optimizer that has not stepped: torch lays out its state with a
step at learning rate 0, whose step count must not change the updates that follow."""

from __future__ import annotations

import copy

import torch

from rlft.trainer.checkpoint.state import apply_tensor_state, tensor_state


def _pair() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=data)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_a_checkpoint_before_the_first_update_leaves_the_updates_as_they_were():
    """A run whose first update was skipped (dynamic sampling found no informative group,
    the guard skipped it) and that saved then: AdamW's step count was left at 1, so every
    later update's bias correction differed from the same run checkpointed later."""
    saved_model, saved_optimizer = _pair()
    plain_model, plain_optimizer = _pair()
    state = tensor_state(saved_model, saved_optimizer)
    saved = copy.deepcopy(state)
    assert all(float(s["step"]) == 0 for s in saved_optimizer.state.values())
    _train(saved_model, saved_optimizer, 3)
    _train(plain_model, plain_optimizer, 3)
    assert _same(saved_model, plain_model)

    # Resumed from that checkpoint, a run takes the same updates too.
    resumed_model, resumed_optimizer = _pair()
    apply_tensor_state(resumed_model, resumed_optimizer, saved)
    _train(resumed_model, resumed_optimizer, 3)
    assert _same(resumed_model, plain_model)


def test_a_stepped_optimizers_count_is_saved_as_it_is():
    model, optimizer = _pair()
    _train(model, optimizer, 2)
    saved = tensor_state(model, optimizer)["optim"]["state"]
    assert saved and all(float(s["step"]) == 2 for s in saved.values())
