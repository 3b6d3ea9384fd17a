"""The `mooncake` transfer backend: KV pages written by the Mooncake transfer engine (TCP or
RDMA) straight from the prefill pool into the decode pool.

What lives here depends on how Mooncake moves bytes, so another backend would not reuse it:
- `engine`: the engine wrapper (asynchronous writes, a group of writes polled in order).
- `environ`: the environment variables the engine must start with (it reads its settings
  there); applied once by the scheduler process, never by this package.
- `prefill`: the prefill manager's control protocol (hellos, room requests, aborts, timeouts,
  registration); `prefill_room`: a room's state shared with its writes; `prefill_sends`: what
  the scheduler's sends of a room become (their checks, one job per decode rank).
- `prefill_writes`: write planning (runs, pieces, staging) and the per-peer in-flight budget,
  both sized to Mooncake TCP's costs and limits; `transfer_workers`: its polling threads,
  built around Mooncake calls that may block for a frozen peer.
- `peers`: a decode rank as prefill addresses it (raw remote addresses, a transfer session).
- `staging`: registered staging areas that turn scattered pages into one write per buffer.
- `slices`: head slices (decode and prefill ranks holding different KV heads) moved as whole
  slice pages through the staging areas.
- `decode`: the decode manager (resolve, hello, requests, updates, quarantine, staging);
  `decode_resolve`: a prefill instance's topology checked and mapped, and the hello it is sent;
  `decode_state`: what the manager keeps per prefill instance and per room.
The contract, the control messages and their channel, the bootstrap server, the heartbeat and
page-run grouping are backend-neutral and live one level up.

Importing this package imports neither torch nor the Mooncake wheel; its modules do.
"""
