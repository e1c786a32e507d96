"""The memory tier's bookkeeping (store stage: no torch), by job: its directory on this host, what it holds, its
budget and recycle pool (`memdir`); where each step lives, recorded in Redis (`stepplaces`); whose step is whose
(`owners`); the peer servers and which hold a host's copies (`peerchoice`); which steps leave memory (`eviction`);
fetching steps from peers for a restore (`peerpulls`); and the seals that spare a restore from memory a second hash
(`seal`). This file stays a docstring (a re-export would be an import edge)."""
