"""``SavedBytes``: the storages autograd saves for backward, each once, parameters left out."""
import torch

from moe_compile.testing.memory import SavedBytes


def test_counts_saved_storages_once_and_leaves_parameters_out():
    lin = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedBytes(lin) as held:
        h = lin(x)  # saves x (the weight is a parameter)
        y = h * h  # saves h twice: one storage
    y.sum().backward()
    assert held.bytes == x.untyped_storage().nbytes() + h.untyped_storage().nbytes() == 2 * 4 * 8 * 4
    with SavedBytes(lin) as none_held:
        with torch.no_grad():
            lin(x)
    assert none_held.bytes == 0
