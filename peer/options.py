"""Every option of every `peer` command, defined once: its name, how a value is read and checked, its default and
its help.

Why one table: the same option reaches a program three ways — as a flag, as a key of a `--config` TOML file, and
as a field default of `peer.daemon.DaemonConfig` — and when each way had its own parser they drifted (a port of
70000 in a config file was silently taken modulo 65536, a string where a number belongs ended in a traceback,
and the daemon's defaults differed from the CLI's). Here a `Kind` reads a flag's text and a TOML value into the
same type, checks the same range and says what is wrong in the same words; `OptionSet` turns a list of `Option`s
into argparse flags, reads config files, and fills in defaults (flags win over the file, the file over defaults).

This module is imported to parse the command line, so it must stay cheap: no torch, no trio (`peer --version`
and `--help` answer without loading either). Checks that need heavy modules (the expert kind needs torch) are done
only for values that need them (a custom `package.module:factory` expert kind is imported to be checked).
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, NoReturn, Sequence, TypeVar, overload

from peer.p2p.budget import BudgetLimits
from peer.topology import Topology

# moe/experts.py registers these (a test compares)
EXPERT_KINDS = ("ffn", "transformer", "deep_ffn", "relu_ffn", "gelu_ffn", "gpt2_ffn", "swiglu")
INNER_WIDTH_KINDS = ("relu_ffn", "gelu_ffn", "gpt2_ffn", "swiglu")  # the kinds KIND@N applies to


class UsageError(Exception):
    """Bad command-line or config-file input; the message is one line and is shown as is (exit code 2)."""


class OptionError(ValueError):
    """A value that an option does not accept; the message says what is wrong with the value, not where it was
    given (the flag or the config file and key is added by whoever read it)."""


# ------------------------------------------------------------------------------------------------------- kinds


class Kind:
    """How one option's values are read: `from_text` for a flag's argument, `from_config` for a TOML value.
    Both end in the same `check`, so a flag and a config key accept the same values with the same messages."""

    what = "a value"

    def from_text(self, text: str) -> Any:
        return self.check(text)

    def from_config(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise OptionError(f"{value!r} is not {self.what}")
        return self.check(value)

    def check(self, value: Any) -> Any:
        return value


_Numeric = TypeVar("_Numeric", int, float)


class _NumberKind(Kind, Generic[_Numeric]):
    """What the integer and the float kinds read alike: a flag's text through `parse` (int or float), a TOML
    value only when it is one of `toml_types` (never a bool, which Python counts as an int), both ending in the
    subclass's `check`."""

    parse: Callable[[Any], _Numeric]
    toml_types: tuple[type, ...]

    def from_text(self, text: str) -> _Numeric:
        try:
            value = self.parse(text)
        except ValueError:
            raise OptionError(f"{text!r} is not {self.what}") from None
        return self.check(value)

    def from_config(self, value: Any) -> _Numeric:
        if isinstance(value, bool) or not isinstance(value, self.toml_types):
            raise OptionError(_wrong_toml_type(value, self.what, self.from_text))
        return self.check(self.parse(value))

    def check(self, value: _Numeric) -> _Numeric:
        return value


class Integer(_NumberKind[int]):
    parse = int
    toml_types = (int,)

    def __init__(self, minimum: int | None = None, maximum: int | None = None, what: str = "a whole number"):
        self.minimum, self.maximum, self.what = minimum, maximum, what

    def check(self, value: int) -> int:
        low, high = self.minimum, self.maximum
        if low is not None and high is not None and not low <= value <= high:
            raise OptionError(f"{value} is outside {low}..{high}")
        if low is not None and value < low:
            raise OptionError(f"{value} must be positive" if low == 1 else f"{value} must be at least {low}")
        if high is not None and value > high:
            raise OptionError(f"{value} must be at most {high}")
        return value


class Number(_NumberKind[float]):
    """A finite float above `minimum` (or at least `minimum` when `inclusive`), at most `maximum` when given."""

    what = "a number"

    parse = float
    toml_types = (int, float)

    def __init__(self, minimum: float = 0.0, *, inclusive: bool = False, maximum: float | None = None):
        self.minimum, self.inclusive, self.maximum = minimum, inclusive, maximum

    def check(self, value: float) -> float:
        if not math.isfinite(value):
            raise OptionError(f"{value} is not a finite number")
        if self.inclusive and value < self.minimum:
            raise OptionError(f"{value:g} must not be negative" if self.minimum == 0
                              else f"{value:g} must be at least {self.minimum:g}")
        if not self.inclusive and value <= self.minimum:
            raise OptionError(f"{value:g} must be positive" if self.minimum == 0
                              else f"{value:g} must be above {self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise OptionError(f"{value:g} must be at most {self.maximum:g}")
        return value


class Text(Kind):
    """A string, optionally one of `choices` or accepted by `validate` (which raises ValueError with a message)."""

    def __init__(self, choices: Sequence[str] | None = None, validate: Callable[[str], Any] | None = None,
                 what: str = "a string"):
        self.choices = tuple(choices) if choices else None
        self.validate = validate
        self.what = f"one of {', '.join(self.choices)}" if self.choices else what

    def check(self, value: str) -> str:
        if self.choices is not None and value not in self.choices:
            raise OptionError(f"{value!r} is not {self.what}")
        if self.validate is not None:
            try:
                self.validate(value)
            except ValueError as error:
                raise OptionError(str(error)) from None
        return value


class PathKind(Kind):
    what = "a path"

    def check(self, value: str) -> Path:
        if not value:
            raise OptionError("an empty path")
        return Path(value)


class Address(Kind):
    what = "HOST:PORT"

    def check(self, value: str) -> tuple[str, int]:
        from peer.p2p.net import parse_address  # only when an address is given: peer.p2p.net brings trio

        try:
            return parse_address(value)
        except ValueError as error:
            raise OptionError(str(error)) from None


class Switch(Kind):
    """An on/off option: a flag without argument, `true`/`false` in a config file."""

    what = "true or false"

    def from_config(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise OptionError(f"{value!r} is not true or false")
        return value


HF_PREFIX = "hf:"  # --model hf:FOLDER: a Hugging Face causal LM from a local folder


@dataclass(frozen=True)
class ModelSpec:
    """`PACKAGE.MODULE:FACTORY` and the keyword arguments the factory is called with: the value of --model, kept
    beside its option (parsing it imports nothing; `peer.user_model` builds the model from it)."""

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, kwargs: dict[str, Any] | None = None) -> "ModelSpec":
        if text.startswith(HF_PREFIX):
            if not text[len(HF_PREFIX):]:
                raise ValueError(f"{text!r} names no folder (hf:FOLDER, a save_pretrained folder or one holding "
                                 f"config.json)")
            return cls(text, dict(kwargs or {}))
        module, sep, name = text.partition(":")
        if not sep or not name.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
            raise ValueError(f"{text!r} is not PACKAGE.MODULE:FACTORY (e.g. mymodel:build)")
        return cls(text, dict(kwargs or {}))

    def __str__(self) -> str:
        return self.factory


class ModelSpecKind(Kind):
    """`PACKAGE.MODULE:FACTORY` on the command line; in a config file the same string, or a `[model]` table with
    `factory` and the keyword arguments the factory is called with."""

    what = "PACKAGE.MODULE:FACTORY"

    def from_config(self, value: Any) -> Any:
        if isinstance(value, dict):
            kwargs = dict(value)
            factory = kwargs.pop("factory", None)
            if not isinstance(factory, str):
                raise OptionError("a [model] table needs factory = \"PACKAGE.MODULE:FACTORY\"")
            return self._parse(factory, kwargs)
        if not isinstance(value, str):
            raise OptionError(f"{value!r} is not {self.what} or a table with `factory`")
        return self._parse(value, {})

    def check(self, value: str) -> Any:
        return self._parse(value, {})

    @staticmethod
    def _parse(text: str, kwargs: dict[str, Any]) -> Any:
        try:
            return ModelSpec.parse(text, kwargs)
        except ValueError as error:
            raise OptionError(str(error)) from None


TRAIN_SIGNALS_EPILOG = (
    "SIGINT (Ctrl-C) or SIGTERM ends the run after the current step: it is evaluated and the result line written "
    "with \"interrupted\": true; exit status 0 for a finished run, 130 after SIGINT, 143 after SIGTERM, 1 on an "
    "error. A second signal exits at once.")


def parse_grid_size(text: str | int) -> tuple[int, ...]:
    """'12' -> (12,), '4x4' -> (4, 4): the shape of a trainer's expert grid."""
    try:
        grid = tuple(int(part) for part in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"grid size {text!r} is not N or AxB (positive integers)") from None
    if not grid or any(g < 1 for g in grid):
        raise ValueError(f"grid size {text!r} is not N or AxB (positive integers)")
    return grid


class GridSize(Kind):
    """N or AxB; kept as the text (`peer train` parses it when it builds the model); an integer in a config."""

    what = "N or AxB"

    def from_config(self, value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise OptionError(f"{value!r} is not {self.what}")
        return self.check(str(value))

    def check(self, value: str) -> str:
        try:
            parse_grid_size(value)
        except ValueError as error:
            raise OptionError(str(error)) from None
        return value


class ExpertKindName(Kind):
    """A registered expert kind (known here by name, so checking one needs no torch) or package.module:factory
    (imported to check it: a custom kind brings its own imports)."""

    what = "an expert kind"

    def check(self, value: str) -> str:
        if value in EXPERT_KINDS:
            return value
        base, at, width = value.partition("@")
        if at and base in INNER_WIDTH_KINDS and width.isdigit() and int(width) > 0:
            return value  # KIND@N: an FFN kind with inner width N
        if ":" not in value:
            raise OptionError(f"unknown expert kind {value!r} (registered: {', '.join(EXPERT_KINDS)}; or "
                              f"package.module:factory)")
        from moe.experts import UnknownExpertKind, get_expert_kind

        try:
            get_expert_kind(value)
        except (UnknownExpertKind, ValueError, ImportError) as error:
            raise OptionError(str(error)) from None
        return value


def _wrong_toml_type(value: Any, what: str, from_text: Callable[[str], Any]) -> str:
    message = f"{value!r} is not {what}"
    if isinstance(value, str):
        try:
            from_text(value)
        except OptionError:
            return message
        return message + " (write it without quotes in TOML)"
    return message


def _grid_pattern(text: str) -> None:
    from moe.grid import GridPattern  # moe.grid is plain Python: cheap, and only when --experts is given

    GridPattern.parse(text)


def _peer_id_hex(text: str) -> None:
    if len(text) != 40 or any(c not in "0123456789abcdef" for c in text.lower()):
        raise ValueError(f"{text!r} is not a PeerID (40 hex digits, as `peer join` prints it)")


POSITIVE_INT = Integer(minimum=1)
PORT = Integer(0, 65535, what="a port number")
POSITIVE = Number()
NOT_NEGATIVE = Number(inclusive=True)
FRACTION = Number(inclusive=True, maximum=1.0)
TEXT = Text()
PATH = PathKind()
ADDRESS = Address()
SWITCH = Switch()


# ------------------------------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Option:
    """One option: `--NAME` on the command line, `NAME` (or with underscores) in a config file, `dest` in the
    parsed namespace and in `DaemonConfig`."""

    name: str
    kind: Kind
    default: Any
    help: str
    shown_default: str | None = None  # what --help says the default is, where the value alone would not say it
    metavar: str | None = None
    many: bool = False  # several values after the flag; a list (or one string) in a config file
    in_config: bool = True
    required: bool = False

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    def help_text(self) -> str:
        if self.shown_default is not None:
            shown = self.shown_default
        elif isinstance(self.default, bool):
            shown = "on" if self.default else "off"
        else:
            shown = str(self.default)
        return f"{self.help} (default: {shown})".replace("%", "%%")

    def from_config(self, value: Any) -> Any:
        if self.many:
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, list):
                raise OptionError(f"{value!r} is not {self.kind.what} or a list of them")
            return [self.kind.from_config(item) for item in values]
        return self.kind.from_config(value)

    def argparse_type(self) -> Callable[[str], Any]:
        def parse(text: str) -> Any:
            try:
                return self.kind.from_text(text)
            except OptionError as error:
                raise argparse.ArgumentTypeError(str(error)) from None

        parse.__name__ = self.name  # argparse names the type in some messages
        return parse


CONFIG = Option("config", PATH, None, "TOML file with any of these options as keys, e.g. `hidden-dim = 64`; "
                "flags win over it", shown_default="none", metavar="FILE", in_config=False)


class OptionSet:
    """The options of one command: adds them to a parser, reads its config files, completes a parsed namespace.
    `finish` runs on the completed namespace (derived defaults that depend on other options)."""

    def __init__(self, command: str, options: Sequence[Option],
                 finish: Callable[[argparse.Namespace], object] | None = None):
        self.command = command
        self.options = [CONFIG, *options]
        self.finish = finish
        self.by_key = {option.name: option for option in self.options if option.in_config}
        names = [option.name for option in self.options]
        if len(set(names)) != len(names):
            raise ValueError(f"{command}: an option is defined twice")

    def __getitem__(self, name: str) -> Option:
        for option in self.options:
            if option.name == name or option.dest == name:
                return option
        raise KeyError(name)

    def defaults(self) -> dict[str, Any]:
        """dest -> default, for everything but --config (DaemonConfig takes its defaults from here)."""
        return {option.dest: option.default for option in self.options if option is not CONFIG}

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add the flags. Their argparse default is SUPPRESS: an absent flag leaves the namespace without the name,
        so `complete` can tell "not given" (the config file or the default applies) from "given"."""
        for option in self.options:
            kwargs: dict[str, Any] = {"help": option.help_text(), "default": argparse.SUPPRESS}
            if isinstance(option.kind, Switch):
                kwargs["action"] = "store_true"
            else:
                kwargs["type"] = option.argparse_type()
                kwargs["metavar"] = option.metavar or _metavar(option)
                if option.many:
                    kwargs["nargs"] = "+"
            parser.add_argument(option.flag, **kwargs)
        if isinstance(parser, OptionParser):
            parser.option_set = self

    def load_config(self, path: Path) -> dict[str, Any]:
        """dest -> checked value for every key of the TOML file; UsageError (one line, file and key) otherwise."""
        try:
            with open(path, "rb") as file:
                raw = tomllib.load(file)
        except OSError as error:
            raise UsageError(f"cannot read config file {path}: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise UsageError(f"config file {path} is not valid TOML: {error}") from None
        values: dict[str, Any] = {}
        for key, value in raw.items():
            option = self.by_key.get(key.replace("_", "-"))
            if option is None:
                close = difflib.get_close_matches(key.replace("_", "-"), list(self.by_key), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" ({self.command} takes: " \
                                                                      f"{', '.join(self.by_key)})"
                raise UsageError(f"config file {path}: unknown option {key!r}{hint}")
            try:
                values[option.dest] = option.from_config(value)
            except OptionError as error:
                raise UsageError(f"config file {path}: {key}: {error}") from None
        return values

    def complete(self, namespace: argparse.Namespace) -> argparse.Namespace:
        """Defaults, overridden by the config file, overridden by flags; then the required options and `finish`."""
        config = getattr(namespace, "config", None)
        from_file = self.load_config(config) if config is not None else {}
        for option in self.options:
            if option.dest not in vars(namespace):
                default = list(option.default) if isinstance(option.default, list) else option.default
                setattr(namespace, option.dest, from_file.get(option.dest, default))
        for option in self.options:
            if option.required and getattr(namespace, option.dest) in (None, []):
                raise UsageError(f"{self.command}: {option.flag} is required (as a flag or as `{option.name}` "
                                 f"in --config)")
        if self.finish is not None:
            self.finish(namespace)
        return namespace


def _metavar(option: Option) -> str:
    kind = option.kind
    if isinstance(kind, Text) and kind.choices:
        return "{" + ",".join(kind.choices) + "}"
    if isinstance(kind, Address):
        return "HOST:PORT"
    if isinstance(kind, (Number, Integer)):
        return "N"
    if isinstance(kind, PathKind):
        return "PATH"
    return option.name.replace("-", "_").upper()


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, but lines are not broken at hyphens: paths, patterns and flags in help texts stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


_N = TypeVar("_N")


class OptionParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (UsageError) and which completes its namespace from its
    `option_set` (config file and defaults) as soon as it has parsed: subcommands' parsers complete theirs too.
    `exits=True` (a standalone program) prints the error and exits 2 instead of raising it."""

    def __init__(self, *args: Any, exits: bool = False, **kwargs: Any):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.option_set: OptionSet | None = None
        self.exits = exits

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")

    # the overloads of argparse.ArgumentParser.parse_known_args, which this extends
    @overload
    def parse_known_args(self, args: Iterable[str] | None = None, namespace: None = None
                         ) -> tuple[argparse.Namespace, list[str]]: ...
    @overload
    def parse_known_args(self, args: Iterable[str] | None, namespace: _N) -> tuple[_N, list[str]]: ...
    @overload
    def parse_known_args(self, *, namespace: _N) -> tuple[_N, list[str]]: ...

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        try:
            namespace, extras = super().parse_known_args(args, namespace)
            if self.option_set is not None:
                if extras:  # a command's own parser: report these before what the config file might lack
                    self.error(f"unrecognized arguments: {' '.join(extras)}")
                self.option_set.complete(namespace)
        except UsageError as error:
            if not self.exits:
                raise
            print(f"{self.prog.split()[0]}: error: {error}", file=sys.stderr)  # as the `peer` command prints it
            raise SystemExit(2) from None
        return namespace, extras


# ------------------------------------------------------------------------------------------------------- join

# One option for every command that opens RPC connections: the same flag, the same config key, the same words.
INSECURE_TRANSPORT = Option(
    "insecure-transport", SWITCH, False, "send RPC frames unencrypted and unauthenticated after the handshake "
    "(trusted clusters only); every peer it talks to must pass it too, an encrypting peer refuses it")

# One option for every command that takes part in a swarm: a private swarm's members hold its key.
SWARM_KEY = Option(
    "swarm-key", PATH, None, "a private swarm's key file (`peer keygen --swarm-key FILE` writes one, 0600): only "
    "peers holding the same key complete an RPC handshake or get an answer from the DHT",
    shown_default="none: an open swarm", metavar="FILE")
ALLOW_PEERS = Option(
    "allow-peers", PATH, None, "file of PeerIDs (hex, one per line, # comments): RPC handshakes with any other peer "
    "are refused", shown_default="any peer", metavar="FILE")

def check_no_experts(args: argparse.Namespace) -> None:
    """--no-experts with --experts or --num-experts (from flags or the config file) is a contradiction: one line,
    instead of silently dropping either."""
    if not getattr(args, "no_experts", False):
        return
    given = [flag for flag, value in (("--experts", args.experts), ("--num-experts", args.num_experts))
             if value is not None]
    if given:
        raise UsageError(f"peer join: --no-experts serves no experts, so {' and '.join(given)} cannot be given "
                         f"with it (drop one or the other)")


JOIN = OptionSet("peer join", [
    Option("host", TEXT, None, "address to listen on, TCP and UDP (127.0.0.1 for a swarm on this machine only)",
           shown_default="the interface toward the initial peers; all interfaces in a new swarm"),
    Option("port", PORT, 0, "port to listen on, TCP (RPC) and UDP (DHT)", shown_default="0: any free port"),
    Option("announce", ADDRESS, None, "address other peers should use to reach this one (NAT, containers)",
           shown_default="the address the initial peers see this peer at; the listen address with --host"),
    Option("initial-peers", ADDRESS, [], "any running peers to join through", many=True,
           shown_default="none: start a new swarm"),
    Option("identity", PATH, None, "Ed25519 key file, created (mode 0600) on first run, so a restarted peer keeps "
           "its PeerID; refused when group or others may read it", shown_default="a new PeerID every run"),
    Option("experts", Text(validate=_grid_pattern), None, "experts to serve, e.g. 'ffn.[0:4].[0:4]' (half-open "
           "ranges)", shown_default="free uids of the swarm's grid, or ffn.[0:12] in a new swarm",
           metavar="PATTERN"),
    Option("num-experts", POSITIVE_INT, None, "serve this many free uids of the pattern",
           shown_default="all of it; 4 without --experts"),
    Option("no-experts", SWITCH, False, "serve no experts and never import torch: a light peer (tens of MB) for "
           "the DHT, relaying and bootstrapping others, e.g. a swarm's always-on bootstrap; --experts and "
           "--num-experts contradict it"),
    Option("expert-kind", ExpertKindName(), "ffn", f"{', '.join(EXPERT_KINDS)} (KIND@N: inner width N), or "
           "package.module:factory",
           metavar="KIND"),
    Option("hidden-dim", POSITIVE_INT, 64, "experts' hidden size (trainers use the same)"),
    Option("max-batch-size", POSITIVE_INT, 4096, "largest batch per expert"),
    Option("optimizer", Text(["sgd", "adam", "adamw"]), "adam", "experts' optimizer, stepped after every backward"),
    Option("lr", POSITIVE, 1e-3, "experts' learning rate"),
    Option("clip-grad-norm", NOT_NEGATIVE, 1.0, "bound on each expert step: the gradient of a backward batch is "
           "scaled down to this L2 norm when above it, so one caller cannot wreck an expert in a step (0: off)",
           metavar="NORM"),
    Option("checkpoint-dir", PATH, None, "save experts here periodically and on shutdown, reload them on start "
           "(created and checked for writing at start)", shown_default="none: nothing saved", metavar="DIR"),
    Option("checkpoint-interval", POSITIVE, 300.0, "seconds between checkpoints", metavar="SECONDS"),
    Option("device", TEXT, "cpu", "torch device for the experts"),
    Option("threads", POSITIVE_INT, None, "torch threads for expert compute (use 1 when several peers share a "
           "machine)", shown_default="torch's choice"),
    Option("replicate", SWITCH, False, "serve the pattern's experts even where others already do, and keep these "
           "replicas' weights averaged with theirs (hot standby)"),
    Option("average-every", POSITIVE, 30.0, "seconds between replica averaging rounds", metavar="SECONDS"),
    Option("metrics-port", PORT, None, "serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --host "
           "(0: any free port, printed)", shown_default="off"),
    Option("log-level", Text(["debug", "info", "warning", "error"]), "info", "what goes to stderr"),
    Option("accept-weights-from", Text(validate=_peer_id_hex, what="a PeerID"), [], "PeerIDs allowed to overwrite "
           "the served experts' weights (upcycling by `moe.swarmify.swarmify(..., upcycle=True)`)", many=True,
           shown_default="nobody", metavar="PEER_ID"),
    Option("trainers", PATH, None, "file of the PeerIDs (one per line, # comments) allowed to train the served "
           "experts (moe.backward, which steps their optimizers); others get moe.not_allowed and change nothing",
           shown_default="anyone who completes the handshake (with a swarm key: its holders)", metavar="FILE"),
    Option("forward-from", PATH, None, "file of the PeerIDs allowed to call the served experts' forward "
           "(same format as --trainers)", shown_default="anyone who completes the handshake", metavar="FILE"),
    INSECURE_TRANSPORT,
    SWARM_KEY,
    ALLOW_PEERS,
    Option("reachability", Text(["auto", "public", "private"]), "auto", "auto: up to 3 initial peers dial this "
           "one back on TCP and UDP; a private peer takes part in the DHT as a client only (never in others' "
           "routing tables, never holding records); public or private: skip the check"),
    Option("relay-limit", POSITIVE_INT, 64, "circuits this peer relays at once for private peers when it is "
           "public (further requests are refused)", metavar="N"),
    Option("relay-rate", POSITIVE, 16.0, "MB/s (10^6 bytes) one relayed circuit may carry", metavar="MB_S"),
    Option("relay-total-rate", POSITIVE, 64.0, "MB/s all relayed circuits together may carry", metavar="MB_S"),
    Option("no-relay", SWITCH, False, "offer no relay service, even when public"),
    Option("budget", Text(validate=BudgetLimits.parse_override, what="NAME=VALUE"), [], "change one limit on "
           "what remote peers may make this peer hold (docs/budgets.md lists them with their defaults), e.g. "
           "requests_per_peer=512 (several: space-separated)", many=True, shown_default="the defaults",
           metavar="NAME=VALUE"),
    Option("dht-disjoint-paths", POSITIVE_INT, 1, "look keys up over this many disjoint paths (S/Kademlia: no peer "
           "is asked by two paths; a key's unsigned value is the one most paths agree on), so lying or colluding "
           "DHT peers must capture most paths to mislead this peer; 1: plain Kademlia", metavar="D"),
    Option("dht-id-difficulty", Integer(0, 24), 0, "proof-of-work PeerIDs: this peer's DHT keeps out of its "
           "routing tables and lookups every peer whose PeerID lacks BITS leading zero bits of work, and makes its "
           "own identity carry them (about 2^BITS key generations, once; an --identity file without them is "
           "refused), so Sybil identities cost work; every server of the swarm should use the same value; 0: off",
           metavar="BITS"),
], finish=check_no_experts)

# ------------------------------------------------------------------------------------------------------- status

STATUS = OptionSet("peer status", [
    Option("initial-peers", ADDRESS, [], "any running peer of the swarm", many=True, required=True,
           shown_default="none: required"),
    Option("json", SWITCH, False, "machine-readable output"),
    Option("timeout", POSITIVE, 3.0, "seconds to wait for each peer", metavar="SECONDS"),
    INSECURE_TRANSPORT,
    SWARM_KEY,
])

# ------------------------------------------------------------------------------------------------------- train

LOCAL_FALLBACKS: dict[str, Any] = {"hidden_dim": 64, "expert_prefix": "ffn", "grid_size": "12"}
# --task lm: the family `peer swarm up --task lm` serves (lm.[0:2].[0:12]: 2 layers of 12 experts)
LM_LOCAL_FALLBACKS: dict[str, Any] = {"hidden_dim": 64, "expert_prefix": "lm", "grid_size": "2x12"}


def resolve_local_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """With --local-experts there is no swarm to take the experts' size, prefix and grid from: the options left
    unset get the values a default `peer join` swarm has (the only place these fallbacks are applied)."""
    if getattr(args, "local_experts", False):
        fallbacks = LM_LOCAL_FALLBACKS if getattr(args, "task", "digits") == "lm" else LOCAL_FALLBACKS
        for name, value in fallbacks.items():
            if getattr(args, name, None) is None:
                setattr(args, name, value)
    return args


TRAIN = OptionSet("peer train", [
    Option("task", Text(["digits", "lm"]), "digits", "digits: a classifier on scikit-learn's digits; lm: a byte-level "
           "transformer language model on the Python standard library's source, one expert grid per layer"),
    Option("model", ModelSpecKind(), None, "your model instead of --task's: a function returning a torch Module, "
           "or (module, loss_fn); imported from the current directory or PYTHONPATH, called with the keyword "
           "arguments of a [model] table in --config (factory = \"PACKAGE.MODULE:FACTORY\", then the arguments); "
           "or hf:FOLDER, a Hugging Face causal LM from a local save_pretrained folder or config.json (no hub); "
           "every parameter is trained here, the swarm only averages", shown_default="none: the --task model",
           metavar="PACKAGE.MODULE:FACTORY"),
    Option("data", PATH, None, "with --model: a .pt or .safetensors file of tensors x and y (integer y: "
           "cross-entropy, float y: mean squared error, unless the factory gives a loss); a .jsonl file of "
           "{\"x\": [...], \"y\": ...} or {\"text\": ..., \"label\": N} lines; PACKAGE.MODULE:FACTORY returning "
           "a torch Dataset of (x, y); or a text file or folder of .txt files (byte windows of --seq-len: the model "
           "maps bytes [B, T] to logits [B, T, V]); 10% held out", shown_default="none", metavar="PATH"),
    Option("seq-len", POSITIVE_INT, 64, "with --task lm or text --data: bytes of context per training window"),
    Option("initial-peers", ADDRESS, [], "any running peers of the swarm", many=True,
           shown_default="none: required unless --local-experts"),
    Option("run-id", TEXT, "digits", "trainers with the same run id train one model together"),
    Option("steps", POSITIVE_INT, 400, "local training steps"),
    Option("batch-size", POSITIVE_INT, 32, "samples per local step"),
    Option("target-batch-size", POSITIVE_INT, 128, "samples the whole swarm processes per collective epoch (one "
           "averaged update)"),
    Option("expert-prefix", TEXT, None, "uid prefix of the experts the daemons serve",
           shown_default="taken from the experts declared in the swarm (lm: the lm family); ffn (lm: lm) with "
           "--local-experts", metavar="NAME"),
    Option("grid-size", GridSize(), None, "expert grid, N or AxB (e.g. 12 for ffn.[0:12]); with --task lm "
           "LAYERSxN (2x12: lm.[0:2].[0:12], one grid of 12 per layer)",
           shown_default="taken from the swarm; 12 (lm: 2x12) with --local-experts", metavar="N|AxB"),
    Option("hidden-dim", POSITIVE_INT, None, "hidden size; must equal the experts'",
           shown_default="taken from the experts declared in the swarm; 64 with --local-experts"),
    Option("k-best", POSITIVE_INT, 4, "experts per sample"),
    Option("lr", POSITIVE, 3e-3, "learning rate of the trainer's layers"),
    Option("average", Text(["gradients", "parameters"]), "gradients", "what trainers average at the end of each "
           "collective epoch"),
    Option("algorithm", Text(["collaborative", "diloco"]), "collaborative", "collaborative: average every collective "
           "epoch; diloco: --inner-steps local steps, then an outer step on the averaged pseudo-gradients (for slow "
           "links)"),
    Option("inner-steps", POSITIVE_INT, 50, "with --algorithm diloco: local steps between outer steps"),
    Option("outer-lr", POSITIVE, None, "with --algorithm diloco: learning rate of the outer SGD (default 0.7; 1.0 "
           "with topk2, topk8)"),
    Option("outer-momentum", NOT_NEGATIVE, None, "with --algorithm diloco: momentum of the outer SGD, Nesterov "
           "when not 0 (default 0.9; 0 with topk2, topk8, whose error feedback carries each round forward)"),
    Option("compression", Text(["none", "float16", "int8", "int4", "int2", "topk2", "topk8"]), "none",
           "with --algorithm diloco: codec of the pseudo-gradients, all lossy ones with error feedback (int8, int4, "
           "int2: blockwise 8, 4 and 2 bits; topk2, topk8: the largest 2% of each chunk of 4096 with 2-bit or "
           "8-bit values)"),
    Option("density", Number(maximum=1.0), 0.02, "with --compression topk2 or topk8: the fraction of each chunk "
           "of 4096 a pseudo-gradient keeps (the receiver reads it from each tensor's header)"),
    Option("overlap", SWITCH, False, "with --algorithm diloco: average in the background and apply the outer update "
           "one outer step late, so compute never waits on the network"),
    Option("fragments", POSITIVE_INT, 1, "with --algorithm diloco: Streaming DiLoCo, the model split into this "
           "many fragments synchronised in turn (an outer round every --inner-steps / N local steps, each sending "
           "1/N of the model), so peak bandwidth drops about N times"),
    Option("exchange", Text(["auto", "butterfly", "gather"]), "auto", "with --algorithm diloco: how a round's "
           "members combine their pseudo-gradients: butterfly all-reduce, gather (each sends its compressed update "
           "to all, all combine the same set: for sparse codecs), or auto (whichever sends fewer bytes)"),
    Option("start-with", POSITIVE_INT, 1, "with --algorithm diloco: wait until this many trainers of the run are "
           "visible before the first step, so the first trainers start from one state together"),
    Option("quorum-min", POSITIVE_INT, 2, "with --algorithm diloco: an outer round starts after its grace window "
           "once at least this many trainers are ready (or every trainer it expects is)"),
    Option("quorum-fraction", FRACTION, 0.5, "with --algorithm diloco: ... and at least this fraction of the "
           "trainers recently live"),
    Option("max-staleness", Integer(minimum=0), 4, "with --algorithm diloco: a late pseudo-gradient joins the next "
           "round, weighted samples / (1 + staleness); staler ones are dropped, with a logged reason"),
    Option("group-size", POSITIVE_INT, 4, "target averaging group size"),
    Option("aggregation", Text(["mean", "centered_clip", "trimmed_mean"]), "mean", "how each averaging part is "
           "reduced: mean, or Byzantine-robust (parts validated against the group's median norm, then CenteredClip "
           "or a coordinate-wise trimmed mean); peers whose parts are rejected in 3 rounds are banned locally"),
    Option("matchmaking-time", POSITIVE, 3.0, "seconds to wait for averaging partners", metavar="SECONDS"),
    Option("client-mode", SWITCH, False, "accept no connections (then this trainer averages only in groups holding a "
           "reachable trainer)"),
    Option("reachability", Text(["auto", "public", "private"]), "auto", "how others reach this trainer (to average "
           "with it, to download its state): auto: the initial peers dial it back, as for `peer join`; a private "
           "trainer holds reservations with 2 relays and announces its relayed address, so trainers behind NATs "
           "average with each other; public or private: skip the check. Ignored with --client-mode"),
    Option("expert-timeout", POSITIVE, 5.0, "seconds per expert call", metavar="SECONDS"),
    Option("expert-grace", NOT_NEGATIVE, 0.2, "seconds to wait for more experts once every sample has one answer",
           metavar="SECONDS"),
    Option("expert-compression", Text(["none", "float16", "uint8", "int8"]), "none", "codec of the activations and "
           "gradients on expert calls, both ways: int8 (blocks of 256 values with a power-of-two scale each, error at "
           "most 1/254 of a block's largest value) sends about 3.9x fewer tensor bytes; calls under 1 KB go exact"),
    Option("seed", Integer(), 0, "order of the batches"),
    Option("checkpoint", PATH, None, "save the trained model here", shown_default="none: not saved"),
    Option("log-every", POSITIVE_INT, 20, "steps between progress lines"),
    Option("local-experts", SWITCH, False, "no swarm: the same model with its experts in this process (a baseline)"),
    Option("expert-lr", POSITIVE, 1e-3, "with --local-experts: the experts' learning rate (as `peer join --lr`)"),
    Option("threads", POSITIVE_INT, 1, "torch threads (the model is small: more threads mostly spin on a busy "
           "machine)"),
    Option("steps-in-flight", POSITIVE_INT, None, "training steps kept going through the swarm at once, so "
           "waiting on the experts' round trips never idles the trainer: each computes on the parameters as they "
           "were when it started, and updates are applied in order, at most N-1 updates stale; 1: one step after "
           "the other", shown_default="2 with remote experts, else 1", metavar="N"),
    Option("max-failed-steps", POSITIVE_INT, 50, "give up after this many consecutive attempts without enough "
           "experts (retried with a growing pause, up to 1 s: about 45 s in all with the default)"),
    INSECURE_TRANSPORT,
    SWARM_KEY,
    ALLOW_PEERS,
    Option("metrics-port", PORT, None, "serve Prometheus metrics at /metrics on this port, on the address that "
           "faces the swarm (127.0.0.1 with --local-experts; 0: any free port, printed on stderr)",
           shown_default="off"),
], finish=resolve_local_defaults)

# ------------------------------------------------------------------------------------------------------- swarm

_TOPOLOGY = {f.name: f.default for f in fields(Topology)}
_SHAPE = [
    Option("task", Text(["digits", "lm"]), _TOPOLOGY["task"], "what the trainers train (see `peer train --task`); "
           "lm: the daemons serve lm.[0:2].[...] (2 transformer layers)"),
    Option("volunteers", POSITIVE_INT, _TOPOLOGY["volunteers"], "volunteer daemons (the first is the bootstrap "
           "peer)"),
    Option("trainers", POSITIVE_INT, _TOPOLOGY["trainers"], "`peer train` processes"),
    Option("experts-per-volunteer", POSITIVE_INT, _TOPOLOGY["experts_per_volunteer"], "experts each volunteer "
           "serves; the grid is volunteers x this many"),
    Option("hidden-dim", POSITIVE_INT, _TOPOLOGY["hidden_dim"], "experts' and trainers' hidden size"),
    Option("steps", POSITIVE_INT, _TOPOLOGY["steps"], "training steps of each trainer"),
    Option("batch-size", POSITIVE_INT, _TOPOLOGY["batch_size"], "samples per trainer step"),
    Option("target-batch-size", POSITIVE_INT, _TOPOLOGY["target_batch_size"], "samples the swarm processes per "
           "collective epoch"),
    Option("private-volunteers", Integer(minimum=0), _TOPOLOGY["private_volunteers"], "volunteers behind NAT, "
           "the last ones (never the bootstrap, so at most all but one): reached only through the public "
           "volunteers' relays or circuits a hole punch upgraded. swarm up runs them with `--reachability "
           "private`; compose puts them on a second network behind a NAT container", metavar="N"),
]
SWARM_UP = OptionSet("peer swarm up", [
    *_SHAPE,
    Option("kill-one-at", POSITIVE, None, "SIGKILL one volunteer this many seconds after the trainers start "
           "training (once each printed a progress line; fault-tolerance demo): the last public one besides the "
           "bootstrap (a relay of the private ones), else the last one", shown_default="never",
           metavar="SECONDS"),
    Option("log-dir", PATH, None, "where each process's output goes", shown_default="runs/swarm-TIME",
           metavar="DIR"),
])
SWARM_COMPOSE = OptionSet("peer swarm compose", _SHAPE)

# ------------------------------------------------------------------------------------------------------- dashboard

DASHBOARD = OptionSet("peer dashboard", [
    Option("initial-peers", ADDRESS, [], "any running peers of the swarm", many=True, required=True,
           shown_default="none: required"),
    Option("host", TEXT, "127.0.0.1", "address the web page is served on (0.0.0.0 shows it to the network)"),
    Option("port", PORT, 8470, "port of the web page (0: any free port)"),
    Option("refresh", POSITIVE, 2.0, "seconds between asking the peers for their status", metavar="SECONDS"),
    Option("timeout", POSITIVE, 3.0, "seconds to wait for each peer", metavar="SECONDS"),
    SWARM_KEY,
])

# ------------------------------------------------------------------------------------------------------- keygen

KEYGEN = OptionSet("peer keygen", [
    Option("swarm-key", PATH, None, "write a fresh random swarm key to this file (mode 0600); hand it to every "
           "member of the private swarm", required=True, shown_default="none: required",
           metavar="FILE"),
    Option("force", SWITCH, False, "replace an existing key file (peers holding the old key no longer reach this "
           "one)"),
])

COMMANDS: dict[str, OptionSet] = {"join": JOIN, "status": STATUS, "train": TRAIN, "swarm up": SWARM_UP,
                                  "swarm compose": SWARM_COMPOSE, "dashboard": DASHBOARD, "keygen": KEYGEN}
