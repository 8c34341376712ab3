"""The hsx component loaded into vLLM: a KV connector (named with
``--kv-transfer-config``'s ``kv_connector_module_path``) on top of vLLM's
``extract_hidden_states`` speculative method, writing PROTOCOL §3 dumps for marked
requests. :mod:`.core` is the pure part; :mod:`.connector` the thin vLLM glue."""
