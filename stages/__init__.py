"""Stages: plain functions from input shards to output shards. Stages never import each other."""
