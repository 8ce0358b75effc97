import re
from pathlib import Path

import pytest

from quantbench.core.errors import UserError
from quantbench.core.files import canonical_sha
from quantbench.recipe import load_recipe, resolve_recipe_path
from quantbench.recipe.methods import AWQSpec, GPTQSpec

REPO = Path(__file__).resolve().parents[2]


def problems(tmp_path, text, overrides=()):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_recipe(path, overrides)
    return info.value.problems


def test_defaults_live_in_the_schema(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("quantize:\n  method: awq\n")
    loaded = load_recipe(path)
    assert isinstance(loaded.recipe.quantize, AWQSpec)
    assert loaded.recipe.quantize.group_size == 64 and loaded.recipe.quantize.symmetric is False
    assert loaded.recipe.model.source == "builtin:smollm2-135m-instruct"
    assert loaded.recipe.calibration.source == "builtin:python-docs"
    assert loaded.name == "r"


def test_every_error_at_once_with_field_and_line(tmp_path):
    found = problems(tmp_path, "model:\n  dtyp: bfloat16\ncalibration:\n  samples: many\nquantize:\n  method: gptq\n  scheme: W4A61\n")
    assert len(found) == 3
    assert found[0].startswith(f"{tmp_path / 'r.yaml'}: model.dtyp (line 2): unknown key 'dtyp'. Did you mean 'dtype'?")
    assert "calibration.samples (line 4)" in found[1] and "'many'" in found[1]
    assert "quantize.scheme (line 7): unknown value 'W4A61'. Did you mean 'W4A16'?" in found[2]


def test_unknown_key_inside_the_method_section_names_its_own_fields(tmp_path):
    [found] = problems(tmp_path, "quantize:\n  method: gptq\n  grup_size: 64\n")
    assert "quantize.grup_size (line 3): unknown key 'grup_size'. Did you mean 'group_size'?" in found
    assert "n_grid" not in found  # an AWQ-only field is not offered for a GPTQ section


def test_unknown_method_lists_the_methods(tmp_path):
    [found] = problems(tmp_path, "quantize:\n  method: gtpq\n")
    assert "quantize.method (line 2): unknown method 'gtpq'. Did you mean 'gptq'? Available: autoround, awq, bnb, distill, fp8, gguf, gptq, rtn, smoothquant, spinquant" in found


def test_wrong_type(tmp_path):
    [found] = problems(tmp_path, "quantize:\n  method: gptq\n  group_size: [64]\n")
    assert "quantize.group_size (line 3)" in found


def test_missing_quantize_section(tmp_path):
    [found] = problems(tmp_path, "model:\n  dtype: bfloat16\n")
    assert "quantize" in found and "Field required" in found


def test_yaml_syntax_error_names_line(tmp_path):
    [found] = problems(tmp_path, "quantize:\n  method: [gptq\n")
    assert "r.yaml: line 3, column 1: YAML syntax error" in found


def test_top_level_must_be_a_mapping(tmp_path):
    [found] = problems(tmp_path, "- a\n- b\n")
    assert "must be a mapping" in found


def test_overrides_are_parsed_as_yaml_and_validated(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("quantize:\n  method: gptq\n")
    loaded = load_recipe(path, ["calibration.samples=8", "quantize.group_size=null", "quantize.ignore=[lm_head, x]"])
    assert loaded.recipe.calibration.samples == 8
    assert isinstance(loaded.recipe.quantize, GPTQSpec) and loaded.recipe.quantize.group_size is None
    assert loaded.recipe.quantize.ignore == ["lm_head", "x"]
    assert problems(tmp_path, "quantize:\n  method: gptq\n", ["calibration.samples"])[0].endswith("expected KEY.PATH=VALUE")


def test_hash_covers_the_resolved_recipe(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("quantize:\n  method: gptq\n")
    b.write_text("# comment\nquantize: {method: gptq, group_size: 64}\n")  # same recipe once resolved
    assert load_recipe(a).sha == load_recipe(b).sha
    assert load_recipe(a, ["calibration.seed=1"]).sha != load_recipe(a).sha


def test_bench_engine_hashes_as_its_old_name_did(tmp_path):
    """`bench.engine` was `bench.backend`: a recipe gives the same sha under either name, the sha it
    had before the rename (the key hashed is the old one), so sweeps and tunes find their runs."""
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("quantize: {method: fp8}\nbench: {profile: tiny, backend: hf}\n")
    new.write_text("quantize: {method: fp8}\nbench: {profile: tiny, engine: hf}\n")
    loaded = load_recipe(new)
    assert loaded.recipe.bench.engine == "hf" and load_recipe(old).sha == loaded.sha
    resolved = {k: v for k, v in loaded.resolved.items() if k not in ("resources", "budget_minutes")}
    resolved["bench"] = {"profile": "tiny", "backend": "hf"}
    assert loaded.sha == canonical_sha(resolved, compact=True)
    assert load_recipe(new, ["bench.engine=auto"]).sha != loaded.sha


def test_unknown_recipe_name_lists_available_and_closest(tmp_path):
    (tmp_path / "awq-int4.yaml").write_text("quantize: {method: awq}\n")
    (tmp_path / "gptq-w4a16.yaml").write_text("quantize: {method: gptq}\n")
    with pytest.raises(UserError) as info:
        resolve_recipe_path("awq-in4", tmp_path)
    assert "unknown recipe 'awq-in4'" in str(info.value)
    assert "Did you mean 'awq-int4'? Available: awq-int4, gptq-w4a16" in str(info.value)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_validates_and_shows_its_command(path):
    loaded = load_recipe(path)
    first = path.read_text().splitlines()[0]
    assert first == f"# Run: make quantize RECIPE={path.stem}"
    group = getattr(loaded.recipe.quantize, "group_size", None)
    assert group is None or 576 % group == 0  # the default model's hidden size


def test_shipped_recipes_cover_the_methods():
    names = {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    assert {"awq-int4", "gptq-w4a16", "gptq-w8a16", "fp8-dynamic", "w8a8-int8"} <= names


def alias_bomb(levels: int = 9) -> str:
    """Ten values, then each level ten aliases of the one before: 10**levels values once expanded."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once_and_never_expanded(tmp_path):
    import time

    started = time.monotonic()
    [found] = problems(tmp_path, alias_bomb() + "description: *a8\nquantize: {method: fp8}\n")
    assert re.search(r"the YAML expands to [\d,]{13,} values, more than 50,000: its aliases", found), found
    # the same through --set (a flow sequence on the command line)
    flow = "[" + ", ".join(["&x [a, a, a, a, a, a, a, a, a, a]"] + ["*x"] * 9) + "]"
    nested = flow
    for _ in range(6):
        nested = "[" + ", ".join([f"&y{_} {nested}"] + [f"*y{_}"] * 9) + "]"
    [found] = problems(tmp_path, "quantize: {method: fp8}\n", [f"description={nested}"])
    assert "--set description=" in found and "more than 50,000" in found
    assert time.monotonic() - started < 10


def test_error_messages_quote_only_a_prefix_of_a_long_value(tmp_path):
    [found] = problems(tmp_path, f"calibration: {{samples: '{'9x' * 5000}'}}\nquantize: {{method: fp8}}\n")
    assert "calibration.samples (line 1)" in found and "(10,002 characters)" in found and len(found) < 400


def test_a_recipe_file_too_large_is_refused(tmp_path):
    [found] = problems(tmp_path, "quantize: {method: fp8}\ndescription: '" + "x" * 1_000_001 + "'\n")
    assert "a settings file is small" in found


def test_every_set_problem_is_reported_with_the_schema_problems(tmp_path):
    recipe = "quantize:\n  method: gptq\nevaluate:\n  suite: default\n"
    found = problems(tmp_path, recipe, ["quantize.bogus=1", "nosuch.section.key=2", "evaluate.suite.x=1"])
    assert len(found) == 3, found
    assert found[0].endswith("--set evaluate.suite.x=1: 'suite' is not a section")
    assert "quantize.bogus (--set quantize.bogus=1): unknown key 'bogus'" in found[1]
    assert "nosuch (--set nosuch.section.key=2): unknown key 'nosuch'" in found[2]
    found = problems(tmp_path, recipe, ["noequals", "quantize.scheme=BAD"])
    assert len(found) == 2, found
    assert found[0].endswith("--set noequals: expected KEY.PATH=VALUE")
    assert "quantize.scheme (--set quantize.scheme=BAD): unknown value 'BAD'" in found[1]


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    found = problems(tmp_path, "quantize:\n  method: gptq\n  group_size: 32\n  group_size: 64\nquantize: {method: awq}\n")
    assert found == [f"{tmp_path / 'r.yaml'}: quantize.group_size: given twice (lines 3 and 4); YAML would keep only the "
                     "last: remove one",
                     f"{tmp_path / 'r.yaml'}: quantize: given twice (lines 1 and 5); YAML would keep only the last: remove one"]


def test_a_key_given_twice_in_a_settings_file_is_refused(tmp_path):
    from quantbench.quality.suite import Suite
    from quantbench.recipe import validate_file

    path = tmp_path / "s.yaml"
    path.write_text("tokens: 640\nwindow: 64\ntokens: 128\n")
    with pytest.raises(UserError) as info:
        validate_file(path, Suite)
    assert info.value.problems == [f"{path}: tokens: given twice (lines 1 and 3); YAML would keep only the last: remove one"]


def test_an_unknown_key_of_an_optional_section_lists_its_fields(tmp_path):
    found = problems(tmp_path, "quantize: {method: fp8}\nevaluate: {foo: 1}\nbench: {profil: x}\n")
    assert found[0].endswith("evaluate.foo (line 2): unknown key 'foo'. Available: suite")
    assert found[1].endswith("bench.profil (line 3): unknown key 'profil'. Did you mean 'profile'? Available: engine, profile")


def test_a_recipe_path_that_is_a_directory_says_so(tmp_path):
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(UserError) as info:
        resolve_recipe_path(str(tmp_path / "d.yaml"))
    assert info.value.problems == [f"{tmp_path / 'd.yaml'}: is a directory, not a recipe file"]


def test_a_suite_or_profile_looked_for_where_there_are_none_says_where(tmp_path, monkeypatch):
    """Run outside the repository (no suites/ or profiles/ here): the message names the directory it
    looked in and how to point at another, not an empty list of choices."""
    from quantbench.core.errors import UserError
    from quantbench.quality.suite import load_suite
    from quantbench.speed.measure import load_profile

    monkeypatch.chdir(tmp_path)
    for env in ("QUANTBENCH_SUITES", "QUANTBENCH_PROFILES"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(UserError) as suite:
        load_suite("default", "evaluate.suite")
    assert str(suite.value).startswith("evaluate.suite: unknown suite 'default' (no suites/default.yaml): there are no "
                                       f"suite files in {tmp_path}/suites/.")
    assert "QUANTBENCH_SUITES" in str(suite.value) and "Available:" not in str(suite.value)
    with pytest.raises(UserError) as profile:
        load_profile("cpu-smoke")
    assert "QUANTBENCH_PROFILES" in str(profile.value)
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "tiny.yaml").write_text("tokens: 640\n")
    with pytest.raises(UserError, match="Did you mean 'tiny'\\? Available: tiny"):
        load_suite("tin")


@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_a_budget_that_is_not_a_finite_number_is_refused(tmp_path, value):
    found = problems(tmp_path, f"quantize: {{method: fp8}}\nbudget_minutes: {value}\n")
    assert found == [f"{tmp_path / 'r.yaml'}: budget_minutes (line 2): Input should be a finite number "
                     f"(got {float(value.replace('.', '', 1))})"]


@pytest.mark.parametrize("extra, least", [("", 3), ("\n  duo_scaling: false", 2)])
def test_an_awq_grid_too_small_to_search_is_refused(tmp_path, extra, least):
    """llm-compressor divides by n_grid - 2 (duo scaling) or n_grid - 1: a smaller grid crashed with a
    ZeroDivisionError after calibrating; refused while reading the recipe, the least that works passes."""
    [found] = problems(tmp_path, f"quantize:\n  method: awq\n  n_grid: {least - 1}{extra}\n")
    assert f"n_grid: {least - 1}: AWQ's grid search needs at least {least} points" in found
    path = tmp_path / "ok.yaml"
    path.write_text(f"quantize:\n  method: awq\n  n_grid: {least}{extra}\n")
    assert load_recipe(path).recipe.quantize.n_grid == least
