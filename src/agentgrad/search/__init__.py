"""Monte-Carlo tree search over agent turns (issue 20): `tree` (the pure PUCT / backup / top-K math) and
`driver` (many trees at once: nodes restored by replaying their actions into a fresh env, candidates sampled
through one decode session for every tree, leaves valued by a value model)."""
