"""The KV cache, one room: the plain cache (`cache`), policies one class each (`policies`), the cache that
holds a policy per (layer, KV head) (`policy_cache`)."""
