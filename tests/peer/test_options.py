"""Every option of `peer join`, `peer train`, `peer status` and `peer swarm up/compose`, given as a flag and as a
`--config` key: bad values end with exit code 2 and one line on stderr naming the flag, or the file and the key;
good values mean the same through both ways. The table must list every option (a test checks), so a new option
cannot arrive without its cases."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from peer.cli import build_parser, main
from peer.options import COMMANDS, EXPERT_KINDS, JOIN, TRAIN
from peer.user_model import ModelSpec

ROOT = Path(__file__).resolve().parents[2]

# family: (bad flag values, bad TOML values, (good flag value, good TOML value, parsed value))
# A bad flag value of None means the option is a switch: `--NAME=yes` is the bad flag.
POSITIVE_INT = (["abc", "0", "-3", "1.5"], ['"abc"', "0", "-3", "1.5", "true", '"7"'], ("7", "7", 7))
PORT = (["abc", "70000", "-1"], ['"abc"', "70000", "-1", "true"], ("4464", "4464", 4464))
POSITIVE = (["fast", "0", "-1", "nan", "inf"], ['"fast"', "0", "-1.5", "nan", "inf", "false"], ("2.5", "2.5", 2.5))
NOT_NEGATIVE = (["abc", "-0.1", "nan"], ['"abc"', "-0.1", "true"], ("0", "0", 0.0))
INTEGER = (["abc", "1.5"], ['"abc"', "1.5", "true"], ("-4", "-4", -4))
NOT_NEGATIVE_INT = (["abc", "1.5", "-1"], ['"abc"', "1.5", "true", "-1"], ("0", "0", 0))
FRACTION = (["abc", "-0.1", "1.5", "nan"], ['"abc"', "-0.1", "1.5", "true"], ("0.25", "0.25", 0.25))
STRING = ([], ["5", "true", "[1]", "{a = 1}"], ("some-text", '"some-text"', "some-text"))
PATH = ([""], ["5", "true", '""'], ("some/dir", '"some/dir"', Path("some/dir")))
SWITCH = ([None], ['"yes"', "1"], (None, "true", True))
ADDRESS = (["nocolon", "host:99999", "host:abc", ":5"], ['"nocolon"', "5", '["host:1", 2]', '"host:0"'],
           ("10.0.0.1:5", '["10.0.0.1:5"]', ("10.0.0.1", 5)))
ONE_ADDRESS = (ADDRESS[0], ADDRESS[1], ("10.0.0.1:5", '"10.0.0.1:5"', ("10.0.0.1", 5)))


def choice(*good: str) -> tuple:
    return (["bogus"], ['"bogus"', "1"], (good[0], f'"{good[0]}"', good[0]))


TOPOLOGY = {name: POSITIVE_INT for name in ("volunteers", "trainers", "experts-per-volunteer", "hidden-dim", "steps",
                                           "batch-size", "target-batch-size")}
TOPOLOGY["task"] = choice("lm", "digits")
TOPOLOGY["private-volunteers"] = (["abc", "-1", "1.5"], ['"abc"', "-1", "1.5", "true"], ("0", "0", 0))
TABLE: dict[str, dict[str, tuple]] = {
    "join": {
        "host": STRING, "port": PORT, "announce": ONE_ADDRESS, "initial-peers": ADDRESS, "identity": PATH,
        "experts": (["ffn.[0:x]", "ffn"], ['"ffn.[0:x]"', "12"], ("ffn.[0:4]", '"ffn.[0:4]"', "ffn.[0:4]")),
        "num-experts": POSITIVE_INT, "no-experts": SWITCH,
        "expert-kind": (["nonexistent"], ['"nonexistent"', "1"], ("deep_ffn", '"deep_ffn"', "deep_ffn")),
        "hidden-dim": POSITIVE_INT, "max-batch-size": POSITIVE_INT, "optimizer": choice("sgd", "adam", "adamw"),
        "lr": POSITIVE, "checkpoint-dir": PATH, "checkpoint-interval": POSITIVE, "device": STRING,
        "threads": POSITIVE_INT, "replicate": SWITCH, "average-every": POSITIVE, "metrics-port": PORT,
        "log-level": choice("debug", "info", "warning", "error"),
        "accept-weights-from": (["xyz"], ['"xyz"', "5"], ("ab" * 20, f'["{"ab" * 20}"]', ["ab" * 20])),
        "insecure-transport": SWITCH, "reachability": choice("auto", "public", "private"),
        "swarm-key": PATH, "allow-peers": PATH,
        "relay-limit": POSITIVE_INT, "relay-rate": POSITIVE, "relay-total-rate": POSITIVE, "no-relay": SWITCH,
        "trainers": PATH, "forward-from": PATH, "clip-grad-norm": NOT_NEGATIVE,
        "dht-disjoint-paths": POSITIVE_INT,
        "dht-id-difficulty": (["abc", "-1", "25", "1.5"], ['"abc"', "-1", "25", "true"], ("3", "3", 3)),
        "budget": (["requests_per_pear=5", "requests_per_peer=x", "requests_per_peer=0", "requests_per_peer"],
                   ['["requests_per_pear=5"]', "5", '["requests_per_peer=-1"]'],
                   ("requests_per_peer=512", '["requests_per_peer=512"]', ["requests_per_peer=512"])),
    },
    "status": {"initial-peers": ADDRESS, "json": SWITCH, "timeout": POSITIVE, "insecure-transport": SWITCH,
               "swarm-key": PATH},
    "train": {
        "initial-peers": ADDRESS, "run-id": STRING, "steps": POSITIVE_INT, "batch-size": POSITIVE_INT,
        "target-batch-size": POSITIVE_INT, "expert-prefix": STRING,
        "grid-size": (["4xq", "0", "x"], ['"4xq"', "0", "true", "1.5"], ("4x3", '"4x3"', "4x3")),
        "hidden-dim": POSITIVE_INT, "k-best": POSITIVE_INT, "lr": POSITIVE,
        "average": choice("parameters", "gradients"), "group-size": POSITIVE_INT, "matchmaking-time": POSITIVE,
        "aggregation": choice("mean", "centered_clip", "trimmed_mean"),
        "algorithm": choice("collaborative", "diloco"), "inner-steps": POSITIVE_INT, "outer-lr": POSITIVE,
        "outer-momentum": NOT_NEGATIVE, "overlap": SWITCH,
        "compression": choice("none", "float16", "int8", "int4", "int2", "topk2", "topk8"),
        "client-mode": SWITCH, "reachability": choice("auto", "public", "private"),
        "expert-timeout": POSITIVE, "expert-grace": NOT_NEGATIVE, "seed": INTEGER,
        "expert-compression": choice("none", "float16", "uint8", "int8"),
        "checkpoint": PATH, "log-every": POSITIVE_INT, "local-experts": SWITCH, "expert-lr": POSITIVE,
        "threads": POSITIVE_INT, "max-failed-steps": POSITIVE_INT, "steps-in-flight": POSITIVE_INT,
        "task": choice("lm", "digits"),
        "seq-len": POSITIVE_INT, "insecure-transport": SWITCH, "metrics-port": PORT,
        "swarm-key": PATH, "allow-peers": PATH, "start-with": POSITIVE_INT, "fragments": POSITIVE_INT,
        "exchange": choice("auto", "butterfly", "gather"),
        "quorum-min": POSITIVE_INT, "quorum-fraction": FRACTION, "max-staleness": NOT_NEGATIVE_INT,
        "density": (["abc", "0", "1.5"], ['"abc"', "0", "1.5", "true"], ("0.5", "0.5", 0.5)),
        "model": (["nocolon", "a:b-c"], ['"nocolon"', "5", "{hidden = 3}"],
                  ("mod:build", '"mod:build"', ModelSpec("mod:build"))),
        "data": PATH,
    },
    "swarm up": {**TOPOLOGY, "kill-one-at": POSITIVE, "log-dir": PATH},
    "swarm compose": TOPOLOGY,
    "dashboard": {"initial-peers": ADDRESS, "host": STRING, "port": PORT, "refresh": POSITIVE, "timeout": POSITIVE,
                  "swarm-key": PATH},
    "keygen": {"swarm-key": PATH, "force": SWITCH},
}


def _cases(kind: str) -> list:
    cases = []
    for command, options in TABLE.items():
        for name, (bad_flags, bad_configs, good) in options.items():
            if kind == "flag":
                cases += [pytest.param(command, name, value, id=f"{command}--{name}={value}") for value in bad_flags]
            elif kind == "config":
                cases += [pytest.param(command, name, value, id=f"{command}:{name}={value}") for value in bad_configs]
            else:
                cases.append(pytest.param(command, name, good, id=f"{command}--{name}"))
    return cases


def _one_error_line(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert lines[0].startswith("peer: error:"), lines[0]
    return lines[0]


def test_the_table_lists_every_option_of_every_command():
    for command, option_set in COMMANDS.items():
        assert set(TABLE[command]) == {o.name for o in option_set.options if o.in_config}, command


@pytest.mark.parametrize("command, name, value", _cases("flag"))
def test_a_bad_flag_value_is_one_line_and_exit_2(capsys, command, name, value):
    flag = f"--{name}"
    argv = [*command.split(), f"{flag}=yes" if value is None else f"{flag}={value}"]
    line = _one_error_line(capsys, main(argv))
    assert flag in line


@pytest.mark.parametrize("command, name, value", _cases("config"))
def test_a_bad_config_value_is_one_line_naming_the_file_and_key_and_exit_2(tmp_path, capsys, command, name, value):
    config = tmp_path / "peer.toml"
    config.write_text(f"{name} = {value}\n")
    line = _one_error_line(capsys, main([*command.split(), "--config", str(config)]))
    assert str(config) in line and f" {name}: " in line


@pytest.mark.parametrize("command, name, good", _cases("good"))
def test_a_good_value_means_the_same_as_a_flag_and_as_a_config_key(tmp_path, command, name, good):
    flag_text, toml_text, expected = good
    dest = name.replace("-", "_")
    flag_args = [f"--{name}"] if flag_text is None else [f"--{name}", flag_text]
    from_flag = build_parser().parse_args([*command.split(), *flag_args, *_required(command, name)])
    config = tmp_path / "peer.toml"
    config.write_text(f"{name} = {toml_text}\n")
    from_config = build_parser().parse_args([*command.split(), "--config", str(config), *_required(command, name)])
    value = getattr(from_flag, dest)
    assert value == getattr(from_config, dest)
    assert value in (expected, [expected])


def _required(command: str, name: str) -> list[str]:
    if command == "keygen":
        return ["--swarm-key", "some/key"] if name != "swarm-key" else []
    return ["--initial-peers", "127.0.0.1:1"] if command in ("status", "dashboard") and name != "initial-peers" else []


@pytest.mark.parametrize("command", list(TABLE))
def test_unknown_config_keys_and_flags_are_one_line_with_a_suggestion(tmp_path, capsys, command):
    config = tmp_path / "peer.toml"
    misspelt = next(iter(TABLE[command])) + "x"
    config.write_text(f"{misspelt} = 3\n")
    line = _one_error_line(capsys, main([*command.split(), "--config", str(config)]))
    assert str(config) in line and "unknown option" in line and "did you mean" in line
    config.write_text("[join]\nport = 1\n")
    line = _one_error_line(capsys, main([*command.split(), "--config", str(config)]))
    assert "unknown option 'join'" in line
    line = _one_error_line(capsys, main([*command.split(), "--no-such-flag"]))
    assert "--no-such-flag" in line


def test_a_config_file_that_is_not_toml_or_missing_is_one_line(tmp_path, capsys):
    config = tmp_path / "peer.toml"
    config.write_text("port = = 3\n")
    assert "not valid TOML" in _one_error_line(capsys, main(["join", "--config", str(config)]))
    assert "cannot read config file" in _one_error_line(capsys, main(["train", "--config", str(tmp_path / "x")]))


def test_flags_win_over_the_config_file_which_wins_over_defaults(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text('port = 1234\nhidden-dim = 32\nexperts = "ffn.[0:3]"\n')
    args = build_parser().parse_args(["join", "--config", str(config), "--port", "0"])
    assert (args.port, args.hidden_dim, args.experts, args.lr) == (0, 32, "ffn.[0:3]", JOIN["lr"].default)


def test_config_keys_may_be_spelled_with_underscores(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text("max_batch_size = 16\ncheckpoint-interval = 5\n")
    args = build_parser().parse_args(["join", "--config", str(config)])
    assert (args.max_batch_size, args.checkpoint_interval) == (16, 5.0)


def test_no_experts_with_experts_or_num_experts_is_one_line_from_flags_or_the_config(tmp_path, capsys):
    for extra in (["--experts", "ffn.[0:2]"], ["--num-experts", "2"]):
        line = _one_error_line(capsys, main(["join", "--no-experts", *extra]))
        assert "--no-experts" in line and extra[0] in line
    config = tmp_path / "peer.toml"
    config.write_text("no-experts = true\nnum-experts = 3\n")
    assert "--num-experts" in _one_error_line(capsys, main(["join", "--config", str(config)]))
    args = build_parser().parse_args(["join", "--no-experts", "--hidden-dim", "8"])  # the others are left alone
    assert args.no_experts and (args.experts, args.num_experts) == (None, None)


def test_status_needs_initial_peers_from_a_flag_or_the_config(tmp_path, capsys):
    assert "--initial-peers is required" in _one_error_line(capsys, main(["status"]))
    config = tmp_path / "peer.toml"
    config.write_text('initial-peers = "127.0.0.1:9"\ntimeout = 0.5\n')
    args = build_parser().parse_args(["status", "--config", str(config)])
    assert args.initial_peers == [("127.0.0.1", 9)] and args.timeout == 0.5


def test_daemon_config_defaults_are_the_join_options():
    from peer.daemon import DaemonConfig

    config = DaemonConfig()
    fields = {f.name for f in dataclasses.fields(DaemonConfig)}
    for name, default in JOIN.defaults().items():
        if name == "log_level":
            continue
        assert name in fields, name
        assert getattr(config, name) == default, name
    assert config.hidden_dim == 64 and config.experts is None


def test_train_defaults_come_from_the_swarm_and_fall_back_for_local_experts():
    swarm = build_parser().parse_args(["train", "--initial-peers", "127.0.0.1:1"])
    assert (swarm.hidden_dim, swarm.expert_prefix, swarm.grid_size) == (None, None, None)
    local = build_parser().parse_args(["train", "--local-experts"])
    assert (local.hidden_dim, local.expert_prefix, local.grid_size) == (64, "ffn", "12")
    mixed = build_parser().parse_args(["train", "--local-experts", "--hidden-dim", "16", "--grid-size", "2x2"])
    assert (mixed.hidden_dim, mixed.expert_prefix, mixed.grid_size) == (16, "ffn", "2x2")


@pytest.mark.parametrize("command", list(TABLE))
def test_every_help_text_shows_its_default(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command.split()[0]]  # the command's own parser
    if " " in command:
        sub = sub._subparsers._group_actions[0].choices[command.split()[1]]
    text = " ".join(sub.format_help().split())
    for option in COMMANDS[command].options:
        assert " ".join(option.help_text().replace("%%", "%").split()) in text, option.name
        assert "(default: " in option.help_text()


def test_expert_kind_help_lists_the_registered_kinds():
    """The built-in kinds, as a fresh process registers them (other tests register kinds of their own)."""
    import subprocess
    import sys

    code = "from moe.experts import registered_kinds; print(*registered_kinds())"
    fresh = subprocess.run([sys.executable, "-c", code],
                           capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    assert sorted(EXPERT_KINDS) == sorted(fresh.stdout.split())
    assert all(kind in JOIN["expert-kind"].help_text() for kind in EXPERT_KINDS)


def test_train_options_are_the_same_in_peer_train_and_python_m_peer_train(capsys):
    from peer import train

    standalone = vars(train.build_parser().parse_args(["--local-experts", "--steps", "9"]))
    through_peer = vars(build_parser().parse_args(["train", "--local-experts", "--steps", "9"]))
    assert standalone == {k: v for k, v in through_peer.items() if k not in ("command", "handler")}
    with pytest.raises(SystemExit) as exit_info:
        train.build_parser().parse_args(["--steps", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps" in err[0]
    assert TRAIN["config"].flag == "--config"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["join", "--help"], ["train", "--help"],
                                  ["swarm", "up", "--help"]])
def test_parsing_imports_neither_torch_nor_trio(argv):
    code = ("import sys\nfrom peer.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
            "heavy = [name for name in ('torch', 'trio') if name in sys.modules]\n"
            "assert not heavy, heavy\nprint('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr
