"""Constituency parsing (§6.3): trees and their linearization, the tree constraint on the search,
EVALB."""
