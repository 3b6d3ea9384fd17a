"""Flow control at a front end: many tenants on one model, with priorities, fair shares and load shedding, after
llm-d's flow control (the Gateway API Inference Extension's): priority bands, fairness between flows inside a
band, a bounded queue with a time to live, the lowest (sheddable) band shed first.

Pure, no asyncio: time is passed in. The admission (`http/flow_gate.py`) waits on it.
- `identity.py` who a request is: its priority (objective header, body field, key's cap) and its flow;
- `policy.py`   what the deployment declares (`--flow-*`): objectives, the allowed range, each key's maximum, the
                queue's bound and time to live;
- `queue.py`    the queue: bands highest first, flows round-robin inside a band, deadlines, eviction when full;
- `stats.py`    what /metrics counts, its flow labels bounded.
"""
