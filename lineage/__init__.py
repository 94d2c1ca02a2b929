"""Content hashes and stage directories: how every artifact gets a path derived from its inputs."""
