"""What one step's outputs cost on the engine process's pipe: a plain tuple per running request
(what engine/wire.py sends) against a NamedTuple per request (named fields), pickled and unpickled
as the pipe does, side by side in one run.

    python -m bench.wire [--rows 256] [--repeat 7]
"""

from __future__ import annotations

import argparse
import pickle
import timeit
from typing import NamedTuple

from superinfer.engine.wire import Outputs
from superinfer.workload.record import write_result


class NamedOutput(NamedTuple):  # the alternative: WireOutput's fields by name
    token_ids: list[int]
    logprobs: list | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list | None


def round_trip_us(message: Outputs, repeat: int, number: int = 200) -> float:
    def once() -> None:
        pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    return min(timeit.repeat(once, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="running requests, one output each")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    fields = [([17], None, False, None, 100, i, 0, None) for i in range(args.rows)]
    ids = [f"chatcmpl-{i:032x}-0" for i in range(args.rows)]
    counts = (args.rows, 0, 0)
    plain = Outputs(list(zip(ids, fields, strict=True)), counts)
    named = Outputs([(rid, NamedOutput(*f)) for rid, f in zip(ids, fields, strict=True)], counts)
    tuple_us, named_us = round_trip_us(plain, args.repeat), round_trip_us(named, args.repeat)
    figures = {"rows": args.rows, "tuple_us": tuple_us, "namedtuple_us": named_us, "ratio": named_us / tuple_us}
    path = write_result("wire", "cpu", figures, goal={"tuple_over_namedtuple": "faster, else use NamedTuples"})
    ratio = named_us / tuple_us
    print(f"{args.rows} outputs a step: tuples {tuple_us:.0f} us, NamedTuples {named_us:.0f} us ({ratio:.1f}x)")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
