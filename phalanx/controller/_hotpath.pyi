from collections.abc import Callable
from typing import Any

def send_small(entries: Any, ranks: list[int], call_id: int, future: Any, prefix: bytes,
               tail: bytes, fail_if_dead: Callable[[Any, int, Any], None]) -> None: ...

class AnswerRouter:
    def __init__(self, read: Callable[[], Any], by_rank: dict[int, Any],
                 channel: object) -> None: ...
    def __call__(self) -> Any: ...
