import pytest

from lightning_cg.engine.encoder import EncoderGraphConfig, PathConfig

PATHS = {"image": PathConfig(min_token_budget=1)}


def test_graph_config_refuses_an_unknown_padding_rule_naming_it_and_the_allowed():
    with pytest.raises(
        ValueError, match=r"padding_rules\['x'\] is 'mirror'; allowed: zero, repeat_last"
    ):
        EncoderGraphConfig(paths=PATHS, padding_rules={"x": "mirror"})


def test_graph_config_refuses_unknown_compile_shapes_naming_them_and_the_allowed():
    with pytest.raises(ValueError, match=r"compile_shapes is 'auto'; allowed: static, dynamic"):
        EncoderGraphConfig(paths=PATHS, compile_shapes="auto")


def test_a_third_party_adapter_compiles_dynamic_shapes_unless_it_says_otherwise():
    # Dynamic is the safe choice for an adapter that does not know its budgets'
    # count: one compile, whatever the ladder.
    assert EncoderGraphConfig(paths=PATHS).compile_shapes == "dynamic"
