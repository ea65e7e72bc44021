"""Weight copies in a fit: graphs that validate between training epochs cast on every
replay unless ``cast_weights_per_run`` says otherwise, so the copies hold no device memory
through training; outside a fit, graphs read copies made once per run."""

import pytest
from test_callback import BUDGETS, datamodule, model, trainer

from lightning_cg.callback.graph_callback import CUDAGraphCallback


def fit(callback: CUDAGraphCallback, net=None) -> None:
    trainer(callback, max_epochs=1).fit(net or model(), datamodule())


def test_a_fit_serves_graphs_without_weight_copies_by_default():
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    fit(callback)
    assert callback.manager.weight_casts is None
    assert callback.last_stats["hits"] > 0


def test_runs_outside_a_fit_read_weight_copies_by_default():
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    trainer(callback).predict(model(), datamodule())
    assert callback.manager.weight_casts is not None


@pytest.mark.parametrize("copies", [True, False])
def test_cast_weights_per_run_set_holds_in_a_fit_and_outside(copies):
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use", cast_weights_per_run=copies)
    net = model()
    fit(callback, net)
    assert (callback.manager.weight_casts is not None) is copies
    trainer(callback).validate(net, datamodule(), verbose=False)
    assert (callback.manager.weight_casts is not None) is copies


def test_a_fit_after_a_validate_drops_the_copies_and_keeps_what_was_learned():
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    net = model()
    trainer(callback).validate(net, datamodule(), verbose=False)
    learned = callback.manager.state_dict()
    assert callback.manager.weight_casts is not None and learned["keys"]
    first = callback.manager
    fit(callback, net)
    assert callback.manager is not first and callback.manager.weight_casts is None
    assert not first.is_captured()  # the old graphs are freed, not kept beside the new
    assert set(callback.manager.state_dict()["keys"]) >= set(learned["keys"])
    # Then a validate outside the fit keeps the graphs that cast on every replay.
    fitted = callback.manager
    trainer(callback).validate(net, datamodule(), verbose=False)
    assert callback.manager is fitted and callback.last_stats["hits"] > 0
    eager = trainer().validate(net, datamodule(), verbose=False)
    graphed = trainer(callback).validate(net, datamodule(), verbose=False)
    assert graphed[0]["val_loss"] == pytest.approx(eager[0]["val_loss"], rel=1e-5)
