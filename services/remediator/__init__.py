"""Automated node repair: detectors, alerts, policy, ladder, guardrails, actions, revalidation."""
