"""The model room: Llama math, paged attention, the KV cache and weight loading. Knows nothing of requests."""
