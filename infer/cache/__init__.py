"""The KV cache: attention metadata, contiguous and paged caches, the page allocator,
the prefix cache, and KV memory accounting."""
