"""polyshard.collectives: autograd-aware collectives, p2p helpers and a byte ledger."""

from polyshard.collectives.autograd import (
    all_gather,
    all_to_all,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter,
    scatter_to,
)
from polyshard.collectives.errors import CollectiveError
from polyshard.collectives.graph_break import eager
from polyshard.collectives.ledger import CommLedger
from polyshard.collectives.p2p import (
    PendingExchange,
    exchange,
    post_exchange,
    recv,
    recv_with_meta,
    send,
    send_with_meta,
)

__all__ = [
    "CollectiveError",
    "CommLedger",
    "PendingExchange",
    "all_gather",
    "all_to_all",
    "copy_to",
    "eager",
    "exchange",
    "gather_from",
    "post_exchange",
    "recv",
    "recv_with_meta",
    "reduce_from",
    "reduce_scatter",
    "scatter_to",
    "send",
    "send_with_meta",
]
