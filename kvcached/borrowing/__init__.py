"""Memory of kvcached's device budget for processes that are not engines.

    import kvcached

    with kvcached.borrow(40 << 30, "cuda:0", timeout_s=60) as r:   # engines give 40 GiB back
        train(...)                                                 # r.nbytes held until the block ends
    r = kvcached.reserve(8 << 30, "cuda:0", on_short="partial")   # a handle: r.nbytes, r.release()

  reservation  reserve / borrow / Reservation: join the budget as a job, gather, release
  priority     priority=True: engines' limits lowered and restored; the guardian
  guard        the guardian process (restores lowered limits of a killed borrower)
  torch_retry  torch_alloc_retry: borrow what a failed PyTorch allocation lacked (untested on a GPU)

``kvctl borrow SIZE -- CMD`` holds memory for a command's lifetime
(kvcached.cli.borrow). docs/LIMITS.md, "Borrowing memory for other jobs".
No torch import here (torch_retry imports it only when it runs).
"""

from kvcached.borrowing.reservation import ENGINE_TAG, Reservation, borrow, reserve
from kvcached.borrowing.torch_retry import AllocRetry, torch_alloc_retry

__all__ = ["ENGINE_TAG", "AllocRetry", "Reservation", "borrow", "reserve", "torch_alloc_retry"]
