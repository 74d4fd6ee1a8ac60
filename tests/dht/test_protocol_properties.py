"""Property tests of the DHT datagram protocol (dht/protocol.py) on structured datagrams.

Valid requests of every RPC name round-trip through `DatagramProtocol.request`/`receive`; the same request with
exactly one argument wrong (wrong type, wrong length, missing, extra) is `Dropped("bad_arguments")`, never an
exception; replies are matched by msg id *and* address; the encoding is byte-identical to the stock
`umsgpack` that `rpcudp` uses (what dht/protocol.py promises with `msgpack` and use_bin_type=True); `batches`
and `parse_contacts` keep their size and shape promises for any input.

Hypothesis runs under the `ci` profile registered in tests/conftest.py (derandomized, a modest number of
examples, no deadline); `HYPOTHESIS_PROFILE=thorough` runs many more.
"""

from __future__ import annotations

import math
from collections import Counter

import umsgpack
from hypothesis import example, given, note
from hypothesis import strategies as st

from dht import protocol as proto

ADDRESS = ("10.0.0.1", 4000)

# ------------------------------------------------------------------------------------------------- strategies

ids = st.binary(min_size=20, max_size=20)
msg_ids = st.binary(min_size=20, max_size=20)
addresses = st.tuples(st.sampled_from(["10.0.0.1", "10.0.0.2", "::1", "h"]), st.integers(1, 65535))
stock_values = (
    st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.booleans()
    | st.text(max_size=60)
    | st.binary(max_size=60)
)
# anything msgpack carries: what a hostile or foreign peer may put where an argument belongs
anything = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)
store_items = st.tuples(ids, stock_values).map(list) | st.tuples(ids, stock_values, st.just(proto.OFFER)).map(list)


@st.composite
def valid_requests(draw, name=st.sampled_from(sorted(proto.KNOWN_METHODS))):
    """(name, args) exactly as kademlia 2.2.3 (or a swarmd node) sends them."""
    name = draw(name)
    node_id = draw(ids)
    if name == "stun":
        return name, []
    if name == "ping":
        return name, [node_id]
    if name in ("find_node", "find_value"):
        return name, [node_id, draw(ids)]
    if name == "store":
        return name, [node_id, draw(ids), draw(stock_values)]
    if name == "swarmd_hello":
        return name, [node_id, draw(st.dictionaries(st.text(max_size=8), anything, max_size=3))]
    if name == "swarmd_find_many":
        return name, [node_id, draw(st.lists(ids, min_size=1, max_size=proto.MAX_BATCH_KEYS))]
    return name, [node_id, draw(st.lists(store_items, min_size=1, max_size=8))]


not_an_id = (
    st.binary(max_size=19) | st.binary(min_size=21, max_size=40) | st.text(min_size=20, max_size=20)
    | st.integers(-(2**63), 2**64 - 1) | st.none() | st.lists(st.integers(0, 255), min_size=20, max_size=20)
)
not_a_stock_value = st.none() | st.lists(anything, max_size=3) | st.dictionaries(st.text(max_size=3), anything,
                                                                                  max_size=2)


@st.composite
def bad_item(draw):
    kind = draw(st.sampled_from(["key", "value", "mark", "length", "type"]))
    key, value = draw(ids), draw(stock_values)
    if kind == "key":
        return [draw(not_an_id), value]
    if kind == "value":
        return [key, draw(not_a_stock_value)]
    if kind == "mark":
        return [key, value, draw(anything.filter(lambda v: v != proto.OFFER))]
    if kind == "length":
        return draw(st.sampled_from([[key], [], [key, value, proto.OFFER, proto.OFFER]]))
    return draw(st.none() | st.binary(max_size=20) | st.text(max_size=5) | st.integers(0, 2**32))


@st.composite
def one_argument_wrong(draw):
    """A valid request with exactly one argument made invalid: (name, args, what was changed)."""
    name, args = draw(valid_requests())
    args = list(args)
    if name == "stun":  # stun takes no arguments: any argument is one too many
        return name, [draw(anything)], "extra argument"
    choices = ["sender id", "missing argument", "extra argument"]
    if len(args) > 1:
        choices.append("second argument")
    change = draw(st.sampled_from(choices))
    if change == "sender id":
        args[0] = draw(not_an_id)
    elif change == "missing argument":
        del args[draw(st.integers(0, len(args) - 1))]
    elif change == "extra argument":
        args.insert(draw(st.integers(0, len(args))), draw(anything))
        if name == "swarmd_hello" and len(args) == 2:  # inserted at the front: the id moved to the second place
            pass
    elif name in ("find_node", "find_value") or (name == "store" and draw(st.booleans())):
        args[1] = draw(not_an_id)
    elif name == "store":
        args[2] = draw(not_a_stock_value)
    elif name == "swarmd_hello":
        args[1] = draw(st.none() | st.lists(anything, max_size=2) | st.text(max_size=4) | st.integers(0, 2**32))
    elif name == "swarmd_find_many":
        keys = args[1]
        how = draw(st.sampled_from(["bad key", "empty", "too many", "not a list"]))
        if how == "bad key":
            keys[draw(st.integers(0, len(keys) - 1))] = draw(not_an_id)
        elif how == "empty":
            keys = []
        elif how == "too many":
            keys = keys + [keys[0]] * (proto.MAX_BATCH_KEYS + 1 - len(keys))
        else:
            keys = draw(st.binary(max_size=20) | st.none() | st.integers(0, 2**32))
        args[1] = keys
        change += f" ({how})"
    else:  # the batched stores
        items = args[1]
        how = draw(st.sampled_from(["bad item", "empty", "too many", "not a list"]))
        if how == "bad item":
            items[draw(st.integers(0, len(items) - 1))] = draw(bad_item())
        elif how == "empty":
            items = []
        elif how == "too many":
            items = items + [items[0]] * (proto.MAX_BATCH_KEYS + 1 - len(items))
        else:
            items = draw(st.binary(max_size=20) | st.none() | st.dictionaries(st.text(max_size=3), ids, max_size=2))
        args[1] = items
        change += f" ({how})"
    return name, args, change


def same(a, b) -> bool:
    """Equality that tells bool from int and float from int, as the wire does."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# -------------------------------------------------------------------------------------------------- requests


@given(valid_requests(), addresses, st.sampled_from([None, 0, proto.FLAG_CLIENT]))
def test_valid_requests_of_every_rpc_arrive_as_sent(request, address, flags):
    name, args = request
    sender = proto.DatagramProtocol(flags=flags)
    msg_id, datagram = sender.request(address, name, args)
    event = proto.DatagramProtocol().receive(datagram, ("10.9.9.9", 7))
    assert isinstance(event, proto.Request) and event.name == name and same(event.args, args)
    assert event.msg_id == msg_id and proto.swarmd_flags(msg_id) == flags


@given(one_argument_wrong(), msg_ids)
@example(("swarmd_store_many", [b"\x01" * 20, [[b"\x02" * 20, b"v", "overwrite"]]], "bad item"), b"\x07" * 20)
@example(("store", [b"\x01" * 20, b"\x02" * 20, None], "second argument"), b"\x07" * 20)
def test_one_wrong_argument_is_dropped_as_bad_arguments(case, msg_id):
    name, args, change = case
    note(f"{name}: {change}: {args!r}")
    datagram = proto.encode_request(msg_id, name, args) if len(proto.pack([name, args])) <= 8192 else None
    if datagram is None:  # too big for rpcudp to send at all; a hostile peer still could
        datagram = bytes([proto.REQUEST]) + msg_id + proto.pack([name, args])
    assert proto.DatagramProtocol().receive(datagram, ADDRESS) == proto.Dropped("bad_arguments", ADDRESS)


@given(msg_ids, st.one_of(
    st.tuples(st.just("malformed_request"), anything.filter(lambda v: not (isinstance(v, list) and len(v) == 2))),
    st.tuples(st.just("malformed_request"), st.tuples(anything.filter(lambda v: not isinstance(v, str)),
                                                      st.lists(anything)).map(list)),
    st.tuples(st.just("malformed_request"), st.tuples(st.sampled_from(sorted(proto.KNOWN_METHODS)),
                                                      anything.filter(lambda v: not isinstance(v, list))).map(list)),
    st.tuples(st.just("unknown_method"), st.tuples(st.text(max_size=20).filter(
        lambda n: n not in proto.KNOWN_METHODS), st.lists(anything)).map(list)),
))
def test_malformed_envelopes_are_dropped_with_their_reason(msg_id, case):
    reason, body = case
    datagram = bytes([proto.REQUEST]) + msg_id + proto.pack(body)
    assert proto.DatagramProtocol().receive(datagram, ADDRESS) == proto.Dropped(reason, ADDRESS)


@given(st.binary(max_size=64), st.integers(0, 255), msg_ids, anything)
def test_any_datagram_is_an_event_never_an_exception(tail, kind, msg_id, body):
    protocol = proto.DatagramProtocol()
    protocol.request(ADDRESS, "ping", [bytes(20)])
    for datagram in (bytes([kind]) + msg_id + tail, bytes([kind]) + msg_id + proto.pack(body) + tail,
                     bytes([kind]) + msg_id + proto.pack(body)[: len(tail)], tail):
        event = protocol.receive(datagram, ADDRESS)
        assert isinstance(event, (proto.Request, proto.Reply, proto.Dropped))


# --------------------------------------------------------------------------------------------------- replies


@given(st.lists(st.tuples(addresses, valid_requests()), min_size=1, max_size=6), st.data())
def test_replies_are_matched_by_msg_id_and_address_only(sent, data):
    protocol = proto.DatagramProtocol()
    outstanding = [(protocol.request(address, name, args)[0], address, name) for address, (name, args) in sent]
    for msg_id, address, name in data.draw(st.permutations(outstanding)):
        result = data.draw(anything)
        wrong = data.draw(addresses.filter(lambda a, address=address: a != address))
        assert protocol.receive(proto.encode_reply(msg_id, result), wrong) == proto.Dropped("forged_reply", wrong)
        stranger = data.draw(msg_ids.filter(lambda m: all(m != o[0] for o in outstanding)))
        assert protocol.receive(proto.encode_reply(stranger, result), address).reason == "unsolicited_reply"
        event = protocol.receive(proto.encode_reply(msg_id, result), address)
        assert isinstance(event, proto.Reply) and event.name == name and same(event.result, result)
        assert protocol.receive(proto.encode_reply(msg_id, result), address).reason == "unsolicited_reply"
    assert protocol.outstanding == 0


# ----------------------------------------------------------------------------------- byte compatibility


@given(msg_ids, st.text(max_size=30), st.lists(anything, max_size=4))
def test_requests_are_byte_identical_to_rpcudp_for_any_arguments(msg_id, name, args):
    payload = umsgpack.packb([name, tuple(args)])  # rpcudp sends the args tuple
    if len(payload) > proto.MAX_REQUEST_PAYLOAD:
        return
    assert proto.encode_request(msg_id, name, args) == b"\x00" + msg_id + payload


@given(msg_ids, anything)
def test_replies_and_values_are_byte_identical_to_umsgpack_both_ways(msg_id, value):
    assert proto.encode_reply(msg_id, value) == b"\x01" + msg_id + umsgpack.packb(value)
    assert proto.pack(value) == umsgpack.packb(value)
    assert same(proto.unpack(umsgpack.packb(value)), value)
    assert same(umsgpack.unpackb(proto.pack(value)), value)


@given(st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False), st.booleans(), st.text(),
                 st.binary(max_size=300), anything))
def test_stock_values_are_exactly_the_scalar_types(value):
    assert proto.is_stock_value(value) == (type(value) in (int, float, bool, str, bytes))
    ok = proto.check_request_args("store", [bytes(20), bytes(20), value])
    assert ok == proto.is_stock_value(value)


# ---------------------------------------------------------------------------------- contacts and batches


contact = st.tuples(ids, st.text(min_size=1, max_size=40), st.integers(1, 65535)).map(list)
bad_contact = st.one_of(
    st.tuples(not_an_id, st.just("10.0.0.1"), st.integers(1, 65535)).map(list),
    st.tuples(ids, st.just(""), st.integers(1, 65535)).map(list),
    st.tuples(ids, st.text(min_size=256, max_size=260), st.integers(1, 65535)).map(list),
    st.tuples(ids, st.just("10.0.0.1"), st.integers(65536, 2**40) | st.integers(-(2**40), 0) | st.booleans()
              | st.floats() | st.text(max_size=3)).map(list),
    st.lists(anything, max_size=4).filter(lambda v: len(v) != 3),
    anything.filter(lambda v: not isinstance(v, list)),
)


@given(st.lists(st.tuples(st.booleans(), contact, bad_contact), max_size=40), st.integers(1, 30))
def test_parse_contacts_keeps_valid_entries_in_order_up_to_the_limit(entries, limit):
    answer = [good if use_good else bad for use_good, good, bad in entries]
    expected = [tuple(good) for use_good, good, _bad in entries if use_good][:limit]
    assert proto.parse_contacts(proto.unpack(proto.pack(answer)), limit) == expected


@given(anything.filter(lambda v: not isinstance(v, list)), st.integers(1, 30))
def test_parse_contacts_of_a_non_list_is_none(answer, limit):
    assert proto.parse_contacts(answer, limit) is None


@given(st.lists(st.tuples(ids, st.binary(max_size=9000) | st.text(max_size=3000) | stock_values,
                          st.booleans()), max_size=90),
       st.sampled_from(["swarmd_store_many", "swarmd_store_find"]))
@example([(bytes([i]) * 20, b"v" * 3000, False) for i in range(5)] + [(b"\xff" * 20, b"w" * 8150, False)],
         "swarmd_store_find")
def test_batches_fit_the_cap_keep_every_item_once_and_pass_the_receivers_check(raw, method):
    items = [(key, value, proto.OFFER) if offer else (key, value) for key, value, offer in raw]
    groups, oversized = proto.batches(method, items)
    batched = [tuple(item) for group in groups for item in group]
    # every item exactly once, in order: batched or set aside for a stock `store`
    in_batch = aside = 0
    for item in items:
        if in_batch < len(batched) and batched[in_batch] == item:
            in_batch += 1
        else:
            assert aside < len(oversized) and oversized[aside] == item[0], "an item lost or reordered"
            aside += 1
    assert in_batch == len(batched) and aside == len(oversized), "an item invented"
    for group in groups:
        assert 0 < len(group) <= proto.MAX_BATCH_KEYS
        datagram = proto.encode_request(bytes(20), method, [bytes(20), group])  # never RequestTooLarge
        assert isinstance(proto.DatagramProtocol().receive(datagram, ADDRESS), proto.Request)
    # set aside only when one item alone would not fit
    for key in oversized:
        item = next(i for i in items if i[0] == key)
        try:
            proto.encode_request(bytes(20), method, [bytes(20), [list(item)]])
        except proto.RequestTooLarge:
            continue
        raise AssertionError(f"an item that fits alone was set aside: {len(proto.pack(list(item)))} bytes")


# ------------------------------------------------------------------------------ the generation goes deep


def test_wrong_argument_cases_reach_the_argument_check(monkeypatch):
    """The properties are only worth something if their datagrams get past msgpack and the envelope checks:
    count how many generated one-argument-wrong requests reach `check_request_args`."""
    counts: Counter = Counter()
    check = proto.check_request_args

    def counting_check(name, args):
        counts[name] += 1
        return check(name, args)

    monkeypatch.setattr(proto, "check_request_args", counting_check)

    @given(one_argument_wrong())
    def run(case):
        name, args, _change = case
        counts["cases"] += 1
        proto.DatagramProtocol().receive(bytes([proto.REQUEST]) + bytes(20) + proto.pack([name, args]), ADDRESS)

    run()
    reached = sum(n for name, n in counts.items() if name != "cases")
    assert reached == counts["cases"]  # every generated case is judged by the argument check
    assert len(counts) - 1 >= math.ceil(0.8 * len(proto.KNOWN_METHODS)), counts  # across the RPC names
