"""Helpers shared by the test rooms: live servers, tiny checkpoints, engines, scripts run as child processes."""
