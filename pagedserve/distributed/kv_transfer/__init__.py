"""Prefill/decode disaggregation: a KV connector moves a prompt's KV cache from a prefill
instance (``kv_producer``) to a decode instance (``kv_consumer``).

The shape follows vLLM's ``KVConnectorBase_V1`` (a scheduler-side half in the engine core that
decides how many of a request's tokens come from outside and what to keep when it finishes, and
a worker-side half beside the KV cache that moves the bytes) and its NixlConnector (the decode
side pulls whole blocks; the prefill side keeps them under a lease until the decode side says it
has read them). Our transport is pyzmq over TCP, our messages msgpack plus raw KV bytes.

The path of one request through ``pagedserve proxy``:

1. The proxy sends it to the prefill instance with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``. The prefill instance computes the prompt;
   when the request finishes, the scheduler side keeps its full prompt blocks (a *hold*) and
   returns ``kv_transfer_params`` (:func:`params.producer_params`): its engine id, transfer
   socket (``remote_host``/``remote_port``), a transfer id and the block ids.
2. The proxy sends the original request with those parameters to the decode instance. Its
   scheduler looks up its own prefix cache first, then asks the connector for the rest of the
   prompt's full blocks, allocates blocks for them and parks the request in
   ``WAITING_FOR_REMOTE_KVS``: it holds its blocks but does not run.
3. The decode worker side pulls the blocks (:mod:`consumer`): a handshake that compares model,
   dtype, block size and KV layout, then reads named by block index *and* the chained block hash
   prefix caching uses (the producer refuses a block whose hash differs), each block checked
   against its digest on arrival, then a ``done`` notice that lets the producer free its hold.
4. When every block has arrived, the request goes back to the waiting queue holding its loaded
   blocks and computes only the prompt's last partial block. A failed or timed-out load either
   recomputes the prompt locally or fails the request (``kv_load_failure_policy``).
"""
