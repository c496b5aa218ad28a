"""Who reads what: the world of readers, shard plans, the up-front look at sources (profile), bucket edges and the
shard index."""
